"""AsyncEngine's pause modes (vLLM's `pause_generation(mode=...)`) with the core in a real
background process: keep freezes and resumes exactly, abort ends what runs, wait drains it."""

import asyncio

from engine import LLM, EngineConfig, SamplingParams
from tests.engine.async_helpers import _collect, _wait_for_tokens
from tests.engine.helpers import random_prompts


def _in_flight(engine, loop, prompts, params, ids):
    tasks = [loop.create_task(_collect(engine, p, params, rid)) for p, rid in zip(prompts, ids)]
    loop.run_until_complete(_wait_for_tokens(engine, ids, 4))
    return tasks


def test_pause_keep_freezes_and_resumes_exactly(engine, cfg, loop):
    prompts = random_prompts(8, 5, 30, 2000, seed=52)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ids = [f"keep{i}" for i in range(8)]
    tasks = _in_flight(engine, loop, prompts, params, ids)

    async def pause_then_resume():
        await engine.pause_generation(mode="keep")
        assert await engine.is_paused()
        before = [len(engine.requests[r].state.outputs[0].token_ids) for r in ids]
        await asyncio.sleep(0.3)
        after = [len(engine.requests[r].state.outputs[0].token_ids) for r in ids]
        await engine.set_weight_version(7)
        await engine.resume_generation()
        assert not await engine.is_paused()
        return before, after, await asyncio.gather(*tasks)

    before, after, outs = loop.run_until_complete(pause_then_resume())
    assert before == after and all(0 < b < 60 for b in before)  # frozen in place
    ref = LLM(EngineConfig(model=cfg.model, max_model_len=512)).generate(prompts, params, use_tqdm=False)
    for o, r, b in zip(outs, ref, before):
        c = o.outputs[0]
        assert c.token_ids == r.outputs[0].token_ids and c.finish_reason == "length"
        assert c.weight_versions == [0] * b + [7] * (60 - b)  # the switch is visible per token
    loop.run_until_complete(engine.set_weight_version(0))


def test_pause_abort_ends_in_flight_and_new_requests_wait(engine, loop):
    ids = [f"ab{i}" for i in range(4)]
    tasks = _in_flight(engine, loop, random_prompts(4, 5, 20, 2000, seed=53),
                       SamplingParams(max_tokens=400, ignore_eos=True), ids)

    async def run():
        await engine.pause_generation(mode="abort")
        outs = await asyncio.gather(*tasks)
        late = asyncio.ensure_future(_collect(engine, [5, 6], SamplingParams(temperature=0, max_tokens=5)))
        await asyncio.sleep(0.3)
        waited = not late.done()
        await engine.resume_generation()
        return outs, waited, await late

    outs, waited, late = loop.run_until_complete(run())
    assert all(o.outputs[0].finish_reason == "abort" and 4 <= len(o.outputs[0].token_ids) < 400 for o in outs)
    assert waited and late.outputs[0].finish_reason == "length" and len(late.outputs[0].token_ids) == 5


def test_pause_wait_drains_in_flight(engine, loop):
    ids = [f"wait{i}" for i in range(4)]
    tasks = _in_flight(engine, loop, random_prompts(4, 5, 20, 2000, seed=54),
                       SamplingParams(max_tokens=50, ignore_eos=True), ids)

    async def run():
        await engine.pause_generation(mode="wait")
        done = [t.done() for t in tasks]
        await engine.resume_generation()
        return done, await asyncio.gather(*tasks)

    done, outs = loop.run_until_complete(run())
    assert all(done)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 50 for o in outs)


def test_pause_wait_finishes_requests_queued_before_it(engine, loop):
    """vLLM's wait_for_inflight_requests: every request sent before the pause finishes while it
    is paused, the queued ones too (max_num_seqs=64 runs at most 64; the extra are queued)."""
    prompts = random_prompts(96, 3, 40, 2000, seed=55)
    lengths = [4 + (7 * i) % 29 for i in range(96)]

    async def run():
        tasks = [asyncio.ensure_future(_collect(engine, p, SamplingParams(temperature=0, max_tokens=n,
                                                                         ignore_eos=True), f"pw{i}"))
                 for i, (p, n) in enumerate(zip(prompts, lengths))]
        await asyncio.sleep(0)  # every request is sent before the pause
        await asyncio.wait_for(engine.pause_generation(mode="wait"), 120)
        done = [t.done() for t in tasks]
        late = asyncio.ensure_future(_collect(engine, [5, 6], SamplingParams(temperature=0, max_tokens=3)))
        await asyncio.sleep(0.3)
        late_waited = not late.done()
        await engine.resume_generation()
        return done, late_waited, await asyncio.gather(*tasks), await late

    done, late_waited, outs, late = loop.run_until_complete(run())
    assert all(done), f"{done.count(False)} of 96 requests sent before the pause had not finished"
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert late_waited and len(late.outputs[0].token_ids) == 3
