"""rollout/client/delta_anchors.py: when the full weights go instead of a delta. Pure: no sidecar."""

from rollout.client.delta_anchors import DeltaAnchors


def test_an_anchor_every_n_pushes_and_after_a_failure():
    a = DeltaAnchors(every=3)
    assert a.due()
    a.count({"delta": False})
    assert not a.due()
    a.count({"delta": True})
    assert not a.due()
    a.count({"delta": True})
    assert a.due()  # the fourth push is full again: two deltas since the last full one
    a.count(RuntimeError("the push failed"))
    assert a.due()


def test_deltas_go_until_one_took_longer_than_a_full_push():
    a = DeltaAnchors()
    assert a.auto() is None  # nothing measured: a delta where it is fewer bytes
    a.count({"delta": False}, 1.7)
    assert a.auto() is None
    a.count({"delta": True}, 0.4)  # a slow link: the delta paid
    assert a.auto() is None
    a.count({"delta": True}, 14.0)  # a fast link: encode and apply cost more than the bytes saved
    assert a.auto() is False  # the full weights, no base kept
    a.count({"delta": False}, 1.6)
    assert a.auto() is False
    a.reset()  # a new group (a sidecar joined, say): measured again
    assert a.auto() is None and a.due()
    a.count({"delta": False}, 0.05)
    a.count({"delta": True}, 0.08)  # a small model's pushes: noise, and cheap either way
    assert a.auto() is None
