"""The chain a push's buckets take when the workers span hosts (weight_sync.common.fan_out): pure parts.
The chain itself is tested on emulated hosts (tests/hosts) and over loopback below."""

import pytest

from weight_sync.common.fan_out import MAX_CHUNK, MIN_CHUNK, chain_order, chunk_bytes


def test_one_host_keeps_the_broadcast():
    assert chain_order({0: "10.0.0.1", 1: "10.0.0.1", 2: "10.0.0.1"}) is None  # all on the trainer's host
    assert chain_order({0: "10.0.0.1", 1: "10.0.0.2"}) is None  # one worker: the broadcast sends once


def test_the_chain_crosses_each_link_once():
    addresses = {0: "10.0.0.1", 1: "10.0.0.3", 2: "10.0.0.2", 3: "10.0.0.3", 4: "10.0.0.1", 5: "10.0.0.2"}
    order = chain_order(addresses)
    assert order[0] == 0 and sorted(order) == list(range(6))
    hosts = [addresses[r] for r in order]
    assert hosts == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.3", "10.0.0.3"]  # trainer's host first
    changes = sum(a != b for a, b in zip(hosts, hosts[1:]))
    assert changes == len(set(hosts)) - 1  # each host entered once


@pytest.mark.parametrize("nbytes", [0, 1, 100_000, 16 * MIN_CHUNK, 10**9])
def test_chunks_stay_within_bounds(nbytes):
    assert MIN_CHUNK <= chunk_bytes(nbytes) <= MAX_CHUNK
    assert chunk_bytes(nbytes) <= max(MIN_CHUNK, nbytes // 16)


def test_a_relay_down_a_chain_delivers_every_byte_to_every_rank():
    """Four gloo ranks as threads (real sockets) with the chain forced on over loopback, in an
    order that is not the rank order: two buckets of random bytes, of several chunks each, arrive
    whole on every rank; after a rank is gone, the relay raises instead of hanging."""
    import torch

    from tests.weight_sync.test_group import _form, _run
    from weight_sync.common.fan_out import ChainRelay

    master, res = _form(4, timeout_s=5.0)
    groups = [master, *res[1:]]
    try:
        order = [0, 2, 3, 1]
        for g in groups:
            g.chain, g._relay = order, ChainRelay(g._pg, order, g.rank)
        buckets = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (3 * 1024 * 1024 + 17, 40_000)]
        got = [[torch.zeros_like(b) for b in buckets] for _ in groups[1:]]

        def run(g, tensors):
            for w in [g.fan_out(t) for t in tensors]:
                g.wait(w, "relay")

        _run([lambda: run(master, buckets)] + [lambda g=g, t=t: run(g, t) for g, t in zip(groups[1:], got)])
        assert all(torch.equal(a, b) for per in got for a, b in zip(per, buckets))

        groups[2].close()  # rank 2, the first link after the trainer, leaves
        out = _run([lambda: run(master, buckets[:1]), lambda: run(groups[3], [torch.zeros_like(buckets[0])])])
        assert all(isinstance(e, Exception) for e in out), out  # both ends fail (within the group's timeout)
    finally:
        for g in groups:
            g.close()


def test_the_trainers_choice_is_every_ranks(monkeypatch):
    """WEIGHT_SYNC_FAN_OUT on the trainer is written into the group: its workers follow it."""
    import torch

    from tests.weight_sync.test_group import _form, _run

    for mode, want in (("chain", [0, 1, 2]), ("auto", None)):  # one host: auto keeps the broadcast
        monkeypatch.setenv("WEIGHT_SYNC_FAN_OUT", mode)
        master, res = _form(3, timeout_s=5.0)
        monkeypatch.delenv("WEIGHT_SYNC_FAN_OUT")
        groups = [master, *res[1:]]
        try:
            assert [g.chain for g in groups] == [want] * 3
            src, dst = torch.arange(5000, dtype=torch.uint8), [torch.zeros(5000, dtype=torch.uint8) for _ in range(2)]
            _run([lambda: master.wait(master.fan_out(src))] + [lambda g=g, d=d: g.wait(g.fan_out(d))
                                                                for g, d in zip(groups[1:], dst)])
            assert all(torch.equal(d, src) for d in dst)
        finally:
            for g in groups:
                g.close()
    monkeypatch.setenv("WEIGHT_SYNC_FAN_OUT", "sideways")
    with pytest.raises(ValueError, match="WEIGHT_SYNC_FAN_OUT"):
        _form(2)
