"""Work in flight on a real sidecar, for tests that act on it mid-way (a kill, a push, a SIGTERM):
they wait for the state they need, read from the sidecar's stats, never for a time that stands
for it; and where they must act before the work can move on, they hold the engine cores stopped
while they check, so the state checked is the state acted on."""

import contextlib
import os
import signal
import time

from engine import SamplingParams

# a two-token request: it ends after its prefill and one decode step, which every sequence running
# beside it on its engine takes too (requests are admitted in order, so any sent before it runs)
MARKER = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def wait_stats(client, ready, what: str, timeout: float = 60.0) -> dict:
    """The sidecar's stats once `ready(stats)`; fails with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not ready(stats := client.stats()):
        assert time.monotonic() < deadline, f"{what} after {timeout:.0f} s: {stats}"
        time.sleep(0.01)
    return stats


def wait_decoding(client, seqs: int) -> None:
    """Until the sidecar (of one engine) holds `seqs` sequences and has decoded them a step: a
    marker sent after them came back."""
    wait_stats(client, lambda s: s["queue_depth"] >= seqs, "the load never reached the engine")
    assert [len(g[0].token_ids) for g in client.generate([[1, 2, 3]], MARKER)] == [2]


def _all_threads_stopped(pid: int) -> bool:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                    return False
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return True


@contextlib.contextmanager
def held(pids: list[int]):
    """The processes `pids` stopped (SIGSTOP, every thread) for the body; continued at its end (a
    killed one ignores it). Ask their sidecar only for stats meanwhile: a health check waits on them."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while not all(_all_threads_stopped(pid) for pid in pids):
            assert time.monotonic() < deadline, f"{pids} not stopped 10 s after SIGSTOP"
            time.sleep(0.001)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def kill_mid_decode(client, marker, pool, start_load, seqs: int, victim: int):
    """Start a load of `seqs` sequences on a sidecar of two engines (`start_load()`, which returns
    its future) and SIGKILL engine `victim`'s core while both engines decode it and no group of it
    has finished, whatever the machine's speed: the cores are held stopped while the load and a
    marker per engine (`marker`: a client of its own, run on `pool`) are placed, and again while
    that state is checked and the victim killed. Returns the load's future."""
    cores = [s["pid"] for s in client.health()["engine_states"]]
    with held(cores):  # nothing can finish: the whole load, then the markers, are placed first
        pending = start_load()
        placed = wait_stats(client, lambda s: s["queue_depth"] == seqs, "the load never reached the engines")
        # the loads are equal, so the least-loaded pick puts one marker on each engine
        markers = pool.submit(marker.generate, [[1, 2, 3], [4, 5, 6]], MARKER)
        both = wait_stats(client, lambda s: s["queue_depth"] == seqs + 2, "the markers never reached the engines")
        assert [b - a for a, b in zip(placed["requests_per_engine"], both["requests_per_engine"])] == [1, 1]
    assert [len(g[0].token_ids) for g in markers.result(timeout=120)] == [2, 2]  # both engines decode the load
    with held(cores):
        stats = client.stats()
        # exact, the cores being stopped: only the markers' tokens are done, the whole load is in flight
        assert stats["generated_tokens"] - placed["generated_tokens"] == 4 and stats["queue_depth"] == seqs, stats
        os.kill(cores[victim], signal.SIGKILL)
    return pending
