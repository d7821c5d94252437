"""bench/settle.py: a sidecar's health replies say whether its weights still move onto 2 MB pages."""

from bench.settle import wait_settled, weights_moving


def _health(*moving):
    return {"engine_states": [{"memory": {"huge_pages_moving": m}} for m in moving]}


def test_any_engine_moving_counts_and_replies_without_the_field_do_not():
    assert weights_moving(_health(0, 1)) and weights_moving([_health(0), _health(1)])
    assert not weights_moving(_health(0, 0)) and not weights_moving({"engine_states": [{}]})


def test_the_wait_ends_when_the_move_does():
    replies = iter([_health(1), _health(1), _health(0)])
    assert wait_settled(lambda: next(replies), limit=60) >= 4.0  # two polls 2 s apart
