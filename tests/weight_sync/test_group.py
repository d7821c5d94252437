"""The weight-sync group on its own: gloo ranks as threads of this process (real sockets, real
TCPStore). Forming, broadcasting, timeouts, checks, closing and forming again."""

import threading
import time

import pytest
import torch

from weight_sync.common.group import GroupError, WeightSyncGroup, backend_for_device

pytestmark = pytest.mark.timeout(60)


def _run(fns):
    """Run callables in threads; return their results (or exceptions) in order."""
    out = [None] * len(fns)

    def wrap(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out[i] = e

    threads = [threading.Thread(target=wrap, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _form(world_size=3, timeout_s=10.0, ranks=None):
    master = WeightSyncGroup.master(world_size=world_size, timeout_s=timeout_s)
    info = master.connection_info()
    ranks = ranks if ranks is not None else list(range(1, world_size))
    res = _run([master.join] + [
        (lambda r=r: WeightSyncGroup.connect(host=info["host"], port=info["port"], world_size=world_size, rank=r,
                                             group_name=info["group_name"], secret=info["secret"], timeout_s=timeout_s))
        for r in ranks
    ])
    return master, res


def test_backend_by_device():
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device(torch.device("cuda", 1)) == "nccl"


def test_form_broadcast_vote_close_and_form_again():
    for _generation in range(2):  # a closed group is replaced by a fresh one
        master, res = _form(3)
        workers = res[1:]
        assert all(isinstance(w, WeightSyncGroup) and w.ready for w in workers), res
        src = torch.arange(1000, dtype=torch.float32)
        dst = [torch.zeros(1000) for _ in workers]

        def bcast(g, t):
            g.wait(g.broadcast(t.view(torch.uint8), src=0))

        _run([lambda: bcast(master, src)] + [lambda g=g, d=d: bcast(g, d) for g, d in zip(workers, dst)])
        assert all(torch.equal(d, src) for d in dst)
        votes = _run([lambda: master.allreduce_max(torch.tensor([0, 5]))] +
                     [lambda g=g, i=i: g.allreduce_max(torch.tensor([i, 5])) for i, g in enumerate(workers)])
        assert all(v.tolist() == [1, 5] for v in votes)
        for g in [master, *workers]:
            g.close()
            g.close()  # idempotent
            assert not g.ready
        with pytest.raises(GroupError):
            master.broadcast(src)


def test_ready_marks_count_wake_the_waiter_and_are_forgotten():
    master, res = _form(3)
    workers = res[1:]
    waited = {}

    def wait(push_id):
        t0 = time.monotonic()
        waited[push_id] = master.wait_ready(push_id, timeout_s=10)
        waited[push_id + "/seconds"] = time.monotonic() - t0

    waiter = threading.Thread(target=wait, args=("p1",))
    waiter.start()
    workers[0].mark_ready("p1")
    time.sleep(0.2)
    assert "p1" not in waited  # one of two workers is not go
    workers[1].mark_ready("p1")  # the last one counted says go
    waiter.join(10)
    assert waited["p1"] is True and waited["p1/seconds"] < 5
    workers[0].mark_ready("p1")  # the count was forgotten with the wait: one again, not go
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="p1"):
        master.wait_ready("p1", timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    waiter = threading.Thread(target=wait, args=("p2",))  # called off while it waits
    waiter.start()
    time.sleep(0.2)
    master.call_off("p2")
    waiter.join(10)
    assert waited["p2"] is False and waited["p2/seconds"] < 5
    for g in [master, *workers]:
        g.close()


def test_missing_rank_times_out():
    t0 = time.monotonic()
    master, res = _form(3, timeout_s=2.0, ranks=[1])  # rank 2 never comes
    assert all(isinstance(r, GroupError) for r in res), res
    assert "rendezvous" in str(res[0]) or "within" in str(res[0])
    assert time.monotonic() - t0 < 15
    master.close()


def test_unreachable_store_times_out():
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="cannot reach"):
        WeightSyncGroup.connect(host="127.0.0.1", port=1, world_size=2, rank=1, group_name="x", secret="s",
                                timeout_s=1.0)
    assert time.monotonic() - t0 < 10


def test_wrong_world_size_and_duplicate_rank_are_named():
    master = WeightSyncGroup.master(world_size=3, timeout_s=2.0)
    info = master.connection_info()
    res = _run([
        lambda: WeightSyncGroup.connect(host=info["host"], port=info["port"], world_size=4, rank=1,
                                        group_name=info["group_name"], secret=info["secret"], timeout_s=2.0),
    ])
    assert isinstance(res[0], GroupError) and "world_size mismatch" in str(res[0])
    res = _run([master.join] + [
        lambda: WeightSyncGroup.connect(host=info["host"], port=info["port"], world_size=3, rank=2,
                                        group_name=info["group_name"], secret=info["secret"], timeout_s=2.0)
        for _ in range(2)
    ])
    assert any(isinstance(r, GroupError) and "claimed twice" in str(r) for r in res[1:]), res
    for r in res:
        if isinstance(r, WeightSyncGroup):
            r.close()
    master.close()


def test_stalled_peer_times_out_the_collective():
    master, res = _form(2, timeout_s=1.5)
    worker = res[1]
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="rank 1"):
        worker.wait(worker.broadcast(torch.zeros(10, dtype=torch.uint8)), "receiving")  # rank 0 never sends
    assert 1.0 < time.monotonic() - t0 < 10
    worker.close()
    master.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        WeightSyncGroup.master(world_size=1)
    with pytest.raises(ValueError):
        WeightSyncGroup(host="127.0.0.1", port=1, world_size=2, rank=2, group_name="x", timeout_s=1, device="cpu",
                        secret="s")
    with pytest.raises(ValueError):
        WeightSyncGroup(host="127.0.0.1", port=1, world_size=2, rank=1, group_name="x", timeout_s=0, device="cpu",
                        secret="s")


def _listening(port: int) -> list[str]:
    """Local addresses with a listening TCP socket on `port` (from /proc/net/tcp and tcp6)."""
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                    out.append(addr)
    return out


def test_store_listens_only_on_the_given_host():
    master = WeightSyncGroup.master(world_size=2, timeout_s=2.0)  # host 127.0.0.1
    try:
        assert _listening(master.port) == ["0100007F"]  # 127.0.0.1, and nothing on 0.0.0.0 or ::
    finally:
        master.close()


def test_joining_needs_the_groups_secret():
    master = WeightSyncGroup.master(world_size=2, timeout_s=1.5)
    info = master.connection_info()
    assert len(info["secret"]) >= 32 and info["secret"] not in repr(master)
    t0 = time.monotonic()
    res = _run([master.join, lambda: WeightSyncGroup.connect(
        host=info["host"], port=info["port"], world_size=2, rank=1, group_name=info["group_name"],
        secret="guessed", timeout_s=1.5)])
    assert isinstance(res[1], GroupError) and "no answer from the store" in str(res[1])
    assert isinstance(res[0], GroupError)  # rank 1 never claimed: the trainer's rendezvous times out
    assert time.monotonic() - t0 < 15
    master.close()
    master, res = _form(2, timeout_s=5.0)  # with the secret it forms
    assert all(isinstance(r, WeightSyncGroup) and r.ready for r in res), res
    for g in [master, *res[1:]]:
        g.close()


def test_a_forming_called_off_frees_every_rank_at_once():
    """Rank 3 never comes (its host went): the trainer calls the forming off, and the trainer's
    own join and every worker's end at once, not at the group's timeout."""
    master = WeightSyncGroup.master(world_size=4, timeout_s=60.0)
    info = master.connection_info()
    _all_called_off(master, [master.join] + [_joiner(info, 4, r) for r in (1, 2)], after_s=1.0)


def test_a_vote_called_off_frees_the_workers_that_wait_for_it():
    """Both workers arrived at the vote's gate; the trainer calls the push off (a third rank went)
    before its own wait: the workers are told at once, and they never vote."""
    master, res = _form(3)
    workers = res[1:]
    for w in workers:
        w.mark_ready("p1")
    threading.Timer(0.5, master.call_off, args=("p1",)).start()
    t0 = time.monotonic()
    assert _run([lambda w=w: w.wait_vote("p1") for w in workers]) == [False, False]
    assert time.monotonic() - t0 < 5
    assert master.wait_ready("p1", timeout_s=5) is False  # the call-off wins over the last arrival
    for w in workers:
        w.mark_ready("p2")
    assert master.wait_ready("p2", timeout_s=5) is True
    assert _run([lambda w=w: w.wait_vote("p2") for w in workers]) == [True, True]
    for g in [master, *workers]:
        g.close()


def test_a_forming_called_off_after_its_gate_opened_ends_the_rendezvous():
    """Rank 2 arrives at the forming gate and dies there (its host went): the gate opens on its
    count, and the trainer and rank 1 wait for its address in the rendezvous. The call-off ends
    that wait too, at once."""
    from torch._C._distributed_c10d import TCPStore

    from weight_sync.common import store_gates as gates

    master = WeightSyncGroup.master(world_size=3, timeout_s=60.0)
    info = master.connection_info()
    ghost = WeightSyncGroup(host=info["host"], port=info["port"], world_size=3, rank=2, group_name=info["group_name"],
                            timeout_s=60.0, device="cpu", secret=info["secret"],
                            store=TCPStore(info["host"], info["port"], None, False))
    gates.arrive(ghost._prefix_store(), gates.FORMING, 3)  # ... and never comes further
    _all_called_off(master, [master.join, _joiner(info, 3, 1)], after_s=1.5)


def _joiner(info: dict, world_size: int, rank: int):
    """A worker's join of the group `info` describes, as a callable for _run."""
    return lambda: WeightSyncGroup.connect(host=info["host"], port=info["port"], world_size=world_size, rank=rank,
                                           group_name=info["group_name"], secret=info["secret"], timeout_s=60.0)


def _all_called_off(master, joins: list, after_s: float) -> None:
    """The forming called off `after_s` into `joins`: every one of them ends at once, called off."""
    threading.Timer(after_s, master.call_off_forming).start()
    t0 = time.monotonic()
    res = _run(joins)
    assert all(isinstance(r, GroupError) and "called off" in str(r) for r in res), res
    assert time.monotonic() - t0 < after_s + 8
    master.close()
