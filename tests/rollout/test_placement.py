"""Session placement over several sidecars (rollout/client/placement.py, issue 66 item 1): a session's
calls stay where its prefix is, new sessions spread by load, a session moves once when its sidecar is
gone or too busy; and through a real client over two real sidecar processes, one of them killed."""

import asyncio
import os
import random
import signal
from collections import Counter

import pytest

from engine import SamplingParams
from rollout import RolloutClient
from rollout.client.placement import Placement
from tests.rollout.sidecar import TOKEN, Sidecar


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_new_sessions_spread_and_each_stays_where_it_started():
    p = Placement(margin=4)
    first = p.place([f"s{k}" for k in range(8)], [0, 1, 2, 3])
    assert sorted(first) == [0, 0, 1, 1, 2, 2, 3, 3]  # ties broken by sessions pinned: no pile-up on one
    p.done(0, 2), p.done(1, 2), p.done(2, 2), p.done(3, 2)
    again = p.place([f"s{k}" for k in range(8)], [0, 1, 2, 3])
    assert again == first and p.stats()["moves"] == 0 and p.stats()["sessions"] == 8


def test_a_session_moves_once_when_its_sidecar_is_gone_or_too_busy():
    p = Placement(margin=2)
    (home,) = p.place(["a"], [0, 1])
    p.done(home)
    (moved,) = p.place(["a"], [1 - home])  # its sidecar no longer serves
    assert moved == 1 - home and p.stats()["moves"] == 1
    p.done(moved)
    p.place(["x", "y", "z"], [moved])  # three in flight where "a" is pinned, none on the other
    (now,) = p.place(["a"], [0, 1])
    assert now == home and p.stats()["moves"] == 2
    (stays,) = p.place(["a"], [0, 1])  # within the margin now: it stays where it moved
    assert stays == home and p.stats()["moves"] == 2


def test_one_long_session_does_not_pull_every_other_one_onto_its_sidecar():
    """torchtitan #3755's failure: a skewed workload (one session busy on its sidecar throughout, many
    short ones three at a time) must spread the short ones over both, and leave the long one home."""
    p = Placement(margin=8)
    (home,) = p.place(["long"], [0, 1])  # in flight for the whole test
    counts = Counter()
    for k in range(40):
        placed = p.place([f"short{k}-{m}" for m in range(3)], [0, 1])
        counts.update(placed)
        for i in placed:
            p.done(i)
    assert counts[home] >= 30 and counts[1 - home] > counts[home]  # of 120: both serve, the long one's the less
    p.done(home)
    assert p.place(["long"], [0, 1]) == [home] and p.stats()["moves"] == 0


def test_the_sidecars_own_load_counts_what_other_clients_have_in_flight():
    """A sidecar that reports prompts of other clients (agents on its HTTP front, another trainer) gets new
    sessions only once the other is as busy; a pinned session leaves it past the margin; ties go to the
    fewer sessions, then the emptier KV cache."""
    p = Placement(margin=4)
    p.observe(0, groups=10, kv_used=0.9)
    assert p.place([f"s{k}" for k in range(10)], [0, 1]) == [1] * 10  # 0 has 10 of others' in flight
    assert p.stats()["others"] == {0: 10} and p.load(0) == 10 and p.load(1) == 10
    p.observe(1, groups=10 + 30)  # its own 10 (ours) and 30 more: "s0" moves to 0 once, past the margin
    assert p.place(["s0"], [0, 1]) == [0] and p.stats()["moves"] == 1
    p.observe(0, groups=p.busy[0])  # the others' prompts there ended: only ours left
    q = Placement()
    q.observe(0, groups=0, kv_used=0.8)
    q.observe(1, groups=0, kv_used=0.1)
    assert q.place(["x"], [0, 1]) == [1] and q.pick([0, 1]) == 0  # the emptier cache, then the less busy
    r = Placement()
    r.place(["y"], [0, 1])  # on 0; then 1 reports a fuller cache (a poll taken while a call ran there)
    r.observe(1, groups=0, kv_used=0.5)
    assert r.place(["z"], [0, 1]) == [1]  # fewer sessions first: a stale KV share does not bunch sessions up


def test_a_small_or_proportionally_small_gap_moves_nothing():
    """The tail of a step (one sidecar's sessions ended sooner) and a gap within the margin keep sessions home;
    ours counted by the larger of what was in flight when the load was asked and now."""
    p = Placement(margin=4)
    p.place([f"a{k}" for k in range(12)], [0, 1])  # 6 each
    p.done(1, 6)  # 1's sessions are between turns: 6 against 0, past the margin and more than twice: moves
    assert p.place(["a0"], [0, 1]) == [1] and p.stats()["moves"] == 1
    p = Placement(margin=4)
    p.place([f"a{k}" for k in range(20)], [0, 1])  # 10 each
    p.done(1, 4)  # 10 against 6: gap 4, within the margin
    assert p.place(["a0"], [0, 1]) == [0] and p.stats()["moves"] == 0
    p.done(1, 1)  # 11 against 5: past the margin, and twice as busy: moves
    assert p.place(["a2"], [0, 1]) == [1] and p.stats()["moves"] == 1
    q = Placement()
    q.place(["x", "y"], [0, 1])
    then = q.asked()
    q.observe(0, groups=1, then=then[0])  # ours then and now: no one else's
    q.done(0)
    q.observe(0, groups=1, then=then[0])  # the report counted our call that has ended since: still no one else's
    assert q.others[0] == 0
    then = q.asked()  # none of ours in flight on 0 when asked; a call starts and ends before the reply is read
    q.pick([0])
    q.done(0)
    q.observe(0, groups=1, then=then[0])  # the report may have counted that call: not taken for another's
    assert q.others[0] == 0
    q.observe(0, groups=3, then=q.asked()[0])  # now 3 that are not ours
    assert q.others[0] == 3


def test_pins_end_by_call_or_by_idling():
    clock = Clock()
    p = Placement(idle_s=10, clock=clock)
    p.place(["a", "b"], [0, 1])
    p.end("a")
    clock.now = 11.0
    p.place(["c"], [0, 1])
    assert p.stats()["pinned"] == 1 and set(p.pins) == {"c"}  # "b" idled out
    p.done(0, 99)
    assert p.busy[0] == 0
    with pytest.raises(ValueError, match="no sidecar serves"):
        p.place(["a"], [])
    with pytest.raises(ValueError):
        Placement(margin=-1)


def _hit_tokens(client) -> int:
    return sum(e["prefix_cache"]["hit_tokens"] for h in client.health() for e in h["engine_states"])


@pytest.mark.timeout(300)
def test_sessions_stay_on_one_sidecar_across_turns_and_move_when_it_is_killed(qwen2_dir):
    """Three-turn episodes (each turn's prompt the last one plus its completion), their order shuffled
    every turn, over two real sidecars: every second turn hits the prefix cache of the sidecar that
    served the session's first (a contiguous split of the shuffled calls would send about half of them
    elsewhere); a sidecar SIGKILLed before the third turn gives its sessions to the other, once each, and
    no episode is lost."""
    a, b = Sidecar(qwen2_dir), Sidecar(qwen2_dir)
    client = RolloutClient([a.url, b.url], token=TOKEN)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        # calls of one prompt and no session, six at once: each to the least busy, so both serve
        # (a contiguous cut of one prompt once sent every such call to the same sidecar)
        before = [s["rollouts"] for s in client.stats()]
        async def six_calls():
            return await asyncio.gather(*(client._client.generate([[9, k, 11]], params) for k in range(6)))

        client._run(six_calls())
        assert sorted(s["rollouts"] - b for s, b in zip(client.stats(), before)) == [3, 3]
        texts = {f"episode-{k}": [5 + k, 17, 33, 2 * k + 40] * 10 for k in range(8)}  # 40 tokens: 2 full blocks
        order = random.Random(0)
        for turn in range(3):
            if turn == 2:
                os.kill(b.proc.pid, signal.SIGKILL)
            names = list(texts)
            order.shuffle(names)
            before = _hit_tokens(client) if turn < 2 else None
            groups = client.generate([texts[n] for n in names], params, sessions=names)
            assert all(len(g) == 1 and len(g[0].token_ids) == 24 for g in groups)
            if turn == 1:  # each session hits all its turn-0 sequence left cached: 63 computed tokens, 3 full blocks
                assert _hit_tokens(client) - before == 8 * 48
            for n, g in zip(names, groups):
                texts[n] = texts[n] + g[0].token_ids
        stats = client.placement_stats()
        assert stats["sessions"] == 8 and stats["pinned"] == 8 and 1 <= stats["moves"] <= 7
        assert client.urls == [a.url]
        (load,) = client.load()  # the sidecar's own, as the placement reads it every second
        assert load["groups"] == 0 and load["version"] == 0 and 0 <= load["kv_used"] <= 1
        assert load["prefix_hit_tokens"] > 0 and load["prefix_query_tokens"] > load["prefix_hit_tokens"]
    finally:
        client.close()
        a.stop()
        b.stop()
