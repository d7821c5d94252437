"""The engine's lifecycle as vLLM's own AsyncLLM tests expect it: a failed forward kills the
engine, a request made while asleep waits for wake_up, a dropped engine takes its core process
with it, an abort is final at once, and one call may carry several prompts."""

import asyncio
import gc
import time

import pytest

from engine import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams
from tests.procs import descendants

EXT = "tests.engine.rpc_extension:RpcTestExtension"


@pytest.fixture(scope="module")
def cfg(qwen2_dir):
    return EngineConfig(model=qwen2_dir, max_num_seqs=16, max_model_len=256, worker_extension_cls=EXT)


@pytest.fixture(scope="module")
def engine(cfg, loop):
    eng = AsyncEngine(cfg)
    yield eng
    eng.shutdown()


async def _last(engine, prompt, params, rid=None):
    last = None
    async for out in engine.generate(prompt, params, request_id=rid):
        last = out
    return last


def test_a_forward_error_makes_the_engine_dead(cfg):
    """7a: as in vLLM, an exception in the model's forward (a CUDA error, an OOM) leaves a context
    nobody should serve from: every in-flight request fails with EngineDeadError, the engine
    reports errored, and every later call raises EngineDeadError."""
    loop = asyncio.new_event_loop()
    eng = AsyncEngine(cfg)
    try:
        async def run():
            await eng.collective_rpc("break_forward")
            tasks = [asyncio.ensure_future(_last(eng, [5, 6, i], SamplingParams(max_tokens=8))) for i in range(4)]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            deadline = time.monotonic() + 10
            while not eng.errored:
                assert time.monotonic() < deadline, "the engine never became errored"
                await asyncio.sleep(0.05)
            with pytest.raises(EngineDeadError):
                await _last(eng, [5], SamplingParams(max_tokens=2))
            with pytest.raises(EngineDeadError):
                await eng.check_health()
            return results

        results = loop.run_until_complete(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "illegal memory access" in str(results[0])  # the cause travels with the error
        assert eng.proc.wait(10) is not None  # the core process is gone, not stepping on
    finally:
        eng.shutdown()
        loop.close()


def test_generate_while_asleep_waits_for_wake_up(engine, loop):
    """7b: a request made while the engine sleeps is held, then completes after wake_up."""
    params = SamplingParams(temperature=0, max_tokens=6)

    async def run():
        before = await _last(engine, [7, 8, 9], params)
        await engine.sleep(1)
        task = asyncio.ensure_future(_last(engine, [7, 8, 9], params))
        await asyncio.sleep(0.5)
        assert not task.done()
        await engine.wake_up()
        return before, await asyncio.wait_for(task, 60)

    before, after = loop.run_until_complete(run())
    assert after.finished and after.outputs[0].token_ids == before.outputs[0].token_ids


def test_generate_while_asleep_at_level_2_waits_too(engine, loop):
    params = SamplingParams(temperature=0, max_tokens=4)

    async def run():
        await engine.sleep(2)
        task = asyncio.ensure_future(_last(engine, [3, 4], params))
        await asyncio.sleep(0.3)
        assert not task.done()
        await engine.wake_up()
        return await asyncio.wait_for(task, 60)

    assert len(loop.run_until_complete(run()).outputs[0].token_ids) == 4


def test_a_dropped_engine_shuts_its_core_down(cfg):
    """7c: an AsyncEngine that is garbage-collected takes its core process with it (vLLM does so
    through a finalizer), whether it served a request or not."""
    for serve in (False, True):
        loop = asyncio.new_event_loop()
        eng = AsyncEngine(cfg)
        pid = eng.proc.pid
        if serve:
            loop.run_until_complete(_last(eng, [1, 2], SamplingParams(max_tokens=2)))
        del eng
        gc.collect()
        deadline = time.monotonic() + 10
        while pid in descendants():
            assert time.monotonic() < deadline, f"core {pid} still alive 10 s after its engine was dropped"
            time.sleep(0.1)
        loop.close()


def test_an_abort_is_final_at_once(engine, loop):
    """7d: vLLM's frontend finalizes an aborted request when `abort` is called: its stream ends
    with finish_reason "abort" even when the core is already running the request's last step."""
    params = SamplingParams(max_tokens=3, ignore_eos=True, output_kind="delta")

    async def run():
        reasons = []
        for i in range(20):
            rid = f"last-{i}"
            gen = engine.generate([4, 5, 6, i], params, request_id=rid)
            out = await gen.__anext__()  # the first token is out: the next steps are the last ones
            # on a loaded machine the last token may have landed before this line runs: then the
            # request had finished before the abort, and "length" is its true end
            done = engine.requests[rid].state.finished
            await engine.abort(rid)
            finals = [o async for o in gen]
            reasons.append(((finals or [out])[-1].outputs[0].finish_reason, done))
        return reasons

    reasons = loop.run_until_complete(run())
    assert sum(not done for _, done in reasons) >= 5, reasons  # the race was really run
    assert {r for r, done in reasons if not done} == {"abort"}


def test_several_prompts_in_one_call(engine, loop):
    """7e: generate(prompt=[...], request_id=[...]) as vLLM's AsyncLLM accepts it: each prompt is
    its own request, their outputs interleaved in one stream."""
    prompts = [[11, 12, 13], "hello world", [{"role": "user", "content": "hi"}]]
    ids = ["p0", "p1", "p2"]
    params = SamplingParams(temperature=0, max_tokens=5)

    async def run():
        outs = [o async for o in engine.generate(prompts, params, request_id=ids)]
        alone = [await _last(engine, p, params) for p in prompts]
        return outs, alone

    outs, alone = loop.run_until_complete(run())
    final = {o.request_id: o for o in outs if o.finished}
    assert sorted(final) == ids
    assert [final[r].outputs[0].token_ids for r in ids] == [a.outputs[0].token_ids for a in alone]


def test_several_prompts_need_as_many_ids(engine, loop):
    async def run(prompts, ids):
        return [o async for o in engine.generate(prompts, SamplingParams(max_tokens=2), request_id=ids)]

    with pytest.raises(ValueError, match="2 prompts but 3 request ids"):
        loop.run_until_complete(run([[1, 2], [3, 4]], ["a", "b", "c"]))
    with pytest.raises(ValueError, match="request ids"):
        loop.run_until_complete(run([1, 2], ["a", "b"]))  # one prompt of two tokens, two ids
    assert loop.run_until_complete(run([1, 2], "one"))[-1].finished  # the engine still serves
