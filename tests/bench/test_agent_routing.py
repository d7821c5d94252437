"""bench.agent_routing: its workload's arithmetic, and a quick run over two real sidecars in which our
placement serves every reusable prompt token from cache."""

import asyncio

import pytest

from bench import agent_routing as AR


def test_a_turn_can_reuse_the_full_blocks_of_the_last_turns_computed_tokens():
    e = AR.make_round(0, 1, 5000, seed=1)[0]
    assert AR.make_round(0, 1, 5000, seed=1)[0] == e and 3 <= len(e.lengths) <= 5 and len(e.tools) == len(e.lengths) - 1
    e.prompt = [1] * 100
    assert AR._turn_done(e, 0, [2] * 20, block=16)  # 119 computed tokens: 7 full blocks
    assert e.reusable == 112 and len(e.prompt) == 120 + len(e.tools[0])
    assert not AR._turn_done(e, len(e.tools), [3] * 5, block=16)  # the last turn: nothing after it


@pytest.mark.timeout(300)
def test_a_quick_run_keeps_every_session_where_its_prefix_is(qwen2_dir):
    args = AR.parse_args(["--quick", "--model", qwen2_dir, "--policies", "static,ours"])
    out = asyncio.run(AR.run(args))
    ours = out["ours"]
    assert len(ours["episodes"]) == 8 and ours["reusable"] > 0
    assert ours["hits"] == ours["reusable"] and ours["placement"]["moves"] == 0
    assert all(b > 0 for b in ours["busy"])  # both sidecars served
    assert out["static"]["reusable"] == ours["reusable"]  # the same tokens, whatever the placement
