"""AsyncEngine with the core in a real background process (its pause modes: test_async_pause.py)."""

import asyncio
import inspect
import os
import random
import signal
import time

import msgspec
import pytest
import torch

from engine import (
    LLM, AsyncEngine, EngineClient, EngineConfig, EngineDeadError, EngineUnhealthyError, SamplingParams,
)
from engine.engine_client import EngineProcess
from tests.engine.async_helpers import _collect, _wait_for_tokens
from tests.engine.helpers import random_prompts
from tests.procs import descendants


def test_concurrent_greedy_matches_offline_llm(engine, cfg, loop):
    prompts = random_prompts(64, 3, 60, 2000, seed=50)
    params = SamplingParams(temperature=0, max_tokens=24)

    async def run():
        return await asyncio.gather(*[_collect(engine, p, params, f"g{i}") for i, p in enumerate(prompts)])

    outs = loop.run_until_complete(run())
    ref = LLM(EngineConfig(model=cfg.model, max_num_seqs=64, max_model_len=512)).generate(prompts, params,
                                                                                       use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert all(o.finished and o.outputs[0].text == r.outputs[0].text for o, r in zip(outs, ref))


def test_a_conversation_is_a_prompt(engine, loop):
    conv = [{"role": "user", "content": "Hello there"}]
    out = loop.run_until_complete(_collect(engine, conv, SamplingParams(temperature=0, max_tokens=4)))
    want = engine.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert out.prompt_token_ids == list(want) and len(out.outputs[0].token_ids) == 4


def test_n_samples_and_streaming_kinds(engine, loop):
    p = random_prompts(1, 10, 10, 2000, seed=51)[0]

    async def run(kind):
        params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=4, ignore_eos=True, output_kind=kind)
        return [out async for out in engine.generate(p, params)]

    cumulative, delta, final = (loop.run_until_complete(run(k)) for k in ("cumulative", "delta", "final"))
    assert len(final) == 1 and final[0].finished
    assert [c.token_ids for c in cumulative[-1].outputs] == [c.token_ids for c in final[0].outputs]
    joined = [[t for out in delta for t in out.outputs[i].token_ids] for i in range(3)]
    assert joined == [c.token_ids for c in final[0].outputs]
    assert "".join(out.outputs[0].text for out in delta) == final[0].outputs[0].text
    assert len(cumulative) > 1


def test_slow_consumer_gets_merged_outputs(engine, loop):
    """A consumer that reads after the request finished gets everything since its last read in
    one output (deltas merged, none lost), however fast the machine steps."""
    async def run():
        outs = []
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind="delta")
        async for out in engine.generate([5, 6, 7], params, request_id="slow-reader"):
            outs.append(out)
            while len(outs) == 1 and not engine.requests["slow-reader"].state.finished:
                await asyncio.sleep(0.01)  # the consumer sleeps through the other 39 steps
        return outs

    outs = loop.run_until_complete(run())
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 40
    # two reads: the first (one token, or a few when the consumer's first wake came late on a
    # loaded machine) and everything since in one merged output
    assert len(outs) == 2 and len(outs[0].outputs[0].token_ids) >= 1, [len(o.outputs[0].token_ids) for o in outs]


def test_cancel_aborts_the_request(engine, loop):
    async def run():
        agen = engine.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), request_id="cancel-me")
        await agen.__anext__()
        await agen.aclose()
        task = asyncio.ensure_future(_collect(engine, [8, 9], SamplingParams(max_tokens=400, ignore_eos=True)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            stats = await engine.get_stats()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                return stats
            await asyncio.sleep(0.02)
        return stats

    stats = loop.run_until_complete(run())
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_abort_returns_partial_output(engine, loop):
    async def run():
        task = asyncio.ensure_future(_collect(engine, [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True),
                                              "to-abort"))
        await _wait_for_tokens(engine, ["to-abort"], 3)
        await engine.abort("to-abort")
        return await task

    out = loop.run_until_complete(run())
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert 3 <= len(out.outputs[0].token_ids) < 400


def test_wake_up_after_sleep_2_serves_the_checkpoint_as_version_0(engine, loop):
    params = SamplingParams(temperature=0, max_tokens=4)

    async def run():
        await engine.set_weight_version(5)
        tagged = await _collect(engine, [9, 10], params)
        await engine.sleep(1)  # the KV cache only: the pushed weights (version 5) stay
        await engine.wake_up()
        kept = await _collect(engine, [9, 10], params)
        await engine.sleep(2)  # the weights too: wake_up reloads the checkpoint
        await engine.wake_up()
        return tagged, kept, await _collect(engine, [9, 10], params)

    tagged, kept, reloaded = loop.run_until_complete(run())
    assert tagged.outputs[0].weight_versions == [5] * 4 and kept.outputs[0].weight_versions == [5] * 4
    assert reloaded.outputs[0].weight_versions == [0] * 4


def test_check_health_is_a_real_check(engine, loop):
    async def run():
        report = await engine.check_health()
        await engine.sleep(1)
        with pytest.raises(EngineUnhealthyError, match="KV cache"):
            await engine.check_health()
        await engine.wake_up()
        await engine.collective_rpc("poison_weights")
        with pytest.raises(EngineUnhealthyError, match="non-finite"):
            await engine.check_health()
        await engine.collective_rpc("reload_weights")
        return report, await engine.check_health()

    report, healed = loop.run_until_complete(run())
    assert report["ok"] and report["problems"] == [] and healed["ok"]


def test_collective_rpc_errors_leave_the_engine_serving(engine, loop):
    async def run():
        assert await engine.collective_rpc("add", args=(2, 3)) == [5]
        t = await engine.collective_rpc("double_tensor", args=(torch.arange(6, dtype=torch.float32).view(2, 3),))
        assert torch.equal(t[0], torch.arange(6, dtype=torch.float32).view(2, 3) * 2)
        for bad in ("__init__", "_prepare", "runner", "shutdown", "nonexistent"):
            with pytest.raises(ValueError, match="not callable"):
                await engine.collective_rpc(bad)
        with pytest.raises(RuntimeError, match="boom from the worker"):
            await engine.collective_rpc("boom")
        with pytest.raises(RuntimeError, match="cannot be sent"):
            await engine.collective_rpc("unsendable")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await engine.collective_rpc("slow", timeout=0.3, args=(1.0,))
        assert time.monotonic() - t0 < 0.9
        out = await _collect(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=5))
        assert len(out.outputs[0].token_ids) == 5
        assert await engine.collective_rpc("model_info")

    loop.run_until_complete(run())


def test_error_kinds_cross_the_process_as_data(engine, loop):
    """Whether a call was refused (ValueError: nothing changed) or failed travels as a field of
    the result, not read out of the error's text."""
    async def run():
        with pytest.raises(ValueError, match="Refusal: nothing changed"):
            await engine.collective_rpc("refuse")
        with pytest.raises(RuntimeError, match="ValueErrorLookalike") as err:
            await engine.collective_rpc("mislabelled")
        assert not isinstance(err.value, ValueError)

    loop.run_until_complete(run())


def test_a_worker_rpc_returning_a_future_is_answered_when_it_completes(engine, loop):
    """A worker method may return a concurrent Future (as vLLM's utility calls may): its
    collective_rpc is answered once a thread completes it, and the engine generates meanwhile."""
    async def run():
        pending = asyncio.ensure_future(engine.collective_rpc("later", args=(7,)))
        await asyncio.sleep(0)  # the call reaches the core before the request
        out = await _collect(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        waited = not pending.done()
        assert await engine.collective_rpc("release_later") == [1]
        return out, waited, await asyncio.wait_for(pending, 10)

    out, waited, value = loop.run_until_complete(run())
    assert len(out.outputs[0].token_ids) == 20 and waited
    assert value == [7]


def test_a_worker_rpc_future_that_fails_keeps_its_error_kind(engine, loop):
    async def run():
        refused = asyncio.ensure_future(engine.collective_rpc("later", kwargs={"error": "refuse"}))
        failed = asyncio.ensure_future(engine.collective_rpc("later", kwargs={"error": "boom later"}))
        await asyncio.sleep(0)
        assert await engine.collective_rpc("release_later") == [2]
        with pytest.raises(ValueError, match="Refusal: refuse"):
            await refused
        with pytest.raises(RuntimeError, match="RuntimeError: boom later") as err:
            await failed
        assert not isinstance(err.value, ValueError)
        return await _collect(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=5))

    assert len(loop.run_until_complete(run()).outputs[0].token_ids) == 5


def test_bad_requests_fail_alone(engine, loop):
    async def run():
        good = asyncio.ensure_future(_collect(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=30)))
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(engine, list(range(3, 600)), SamplingParams())
        with pytest.raises(ValueError, match="vocabulary"):
            await _collect(engine, [5, 10**8], SamplingParams())
        with pytest.raises(ValueError, match="empty"):
            await _collect(engine, [], SamplingParams())
        with pytest.raises(ValueError, match="already running"):
            agen = engine.generate([5], SamplingParams(max_tokens=50), request_id="dup")
            await agen.__anext__()
            await _collect(engine, [5], SamplingParams(), "dup")
        await agen.aclose()
        return await good

    assert len(loop.run_until_complete(run()).outputs[0].token_ids) == 30


def test_parameters_the_core_refuses_to_decode_fail_their_request_alone(engine, loop):
    """AddRequest carries a typed SamplingParams that msgspec decodes (and checks) in the core:
    parameters spoiled after the frontend's checks fail their own request, as a ValueError."""
    spoiled = SamplingParams(max_tokens=5)
    spoiled.max_tokens = 0

    async def run():
        good = asyncio.ensure_future(_collect(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=8)))
        with pytest.raises(ValueError, match="max_tokens must be a positive int"):
            await _collect(engine, [5, 6], spoiled)
        return await good

    assert len(loop.run_until_complete(run()).outputs[0].token_ids) == 8


def test_malformed_frames_do_not_kill_the_core(engine, loop):
    rng = random.Random(0)
    enc = msgspec.msgpack.encode
    junk = [
        lambda: [rng.randbytes(rng.randint(0, 64))],
        lambda: [enc(["add", rng.random(), None])],
        lambda: [enc(["add", "junk", [1, 2, 10**9], {"n": -1}])],
        lambda: [enc(["add", "junk2", [1, 2], {"tempreature": 1}])],
        lambda: [enc(["call", 1, "no_such_method", [], {}])],
        lambda: [enc(["call", 2, "collective_rpc", ["__del__"], {}])],
        lambda: [enc(["abort", [1, 2, 3]])],
        lambda: [enc(msgspec.msgpack.Ext(1, b"\x93\xa5float\x91\x05\x09"))],
        lambda: [enc(["call", 3, "pause", [], {"mode": "sideways"}]), rng.randbytes(8)],
        lambda: [],
    ]
    for i in range(1000):
        frames = junk[i % len(junk)]()
        if frames:
            engine._core.input.send_multipart([engine._core.identity, *frames])

    out = loop.run_until_complete(_collect(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=5)))
    assert len(out.outputs[0].token_ids) == 5 and not engine.errored
    assert loop.run_until_complete(engine.is_paused()) is False


def test_sleep_and_wake_up_keep_generation_correct(engine, loop):
    params = SamplingParams(temperature=0, max_tokens=16)

    async def run():
        ref = await _collect(engine, [9, 10, 11], params)
        results = []
        for level in (1, 2):
            await engine.sleep(level)
            await engine.wake_up()
            results.append(await _collect(engine, [9, 10, 11], params))
        return ref, results

    ref, results = loop.run_until_complete(run())
    assert all(r.outputs[0].token_ids == ref.outputs[0].token_ids for r in results)


def test_both_engines_are_engine_clients(engine):
    """rollout/ types its engines as EngineClient: ours meets it, and VllmEngine has its methods
    (same names, parameters and kinds) and sets its attributes (starting one needs vLLM)."""
    from engine.vllm_engine import VllmEngine

    assert isinstance(engine, EngineClient) and isinstance(engine.proc, EngineProcess)
    methods = {n: m for n, m in vars(EngineClient).items() if callable(m) and not n.startswith("_")}
    assert {"generate", "pause_generation", "collective_rpc", "check_health", "shutdown"} <= set(methods)
    for cls in (AsyncEngine, VllmEngine):
        for name, member in methods.items():
            want, got = inspect.signature(member).parameters, inspect.signature(getattr(cls, name)).parameters
            assert list(got)[:len(want)] == list(want), (cls.__name__, name)
            assert inspect.iscoroutinefunction(getattr(cls, name)) == inspect.iscoroutinefunction(member), name
        assert isinstance(cls.errored, property)
    init = inspect.getsource(VllmEngine.__init__)
    assert all(f"self.{a} =" in init for a in EngineClient.__annotations__)


def test_killed_core_fails_every_waiter_fast(cfg):
    loop = asyncio.new_event_loop()
    eng = AsyncEngine(cfg)
    try:
        async def run():
            tasks = [asyncio.ensure_future(_collect(eng, [5, 6, 7 + i], SamplingParams(max_tokens=500,
                                                                                      ignore_eos=True)))
                     for i in range(8)]
            await asyncio.sleep(0)
            await _wait_for_tokens(eng, list(eng.requests), 1)
            call = asyncio.ensure_future(eng.collective_rpc("slow", args=(30,)))  # in flight when killed
            await asyncio.sleep(0.2)
            os.kill(eng.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.gather(*tasks, call, return_exceptions=True)
            elapsed = time.monotonic() - t0
            with pytest.raises(EngineDeadError):
                await _collect(eng, [5], SamplingParams())
            return results, elapsed

        results, elapsed = loop.run_until_complete(run())
        assert all(isinstance(r, EngineDeadError) for r in results), [r for r in results if not isinstance(r, EngineDeadError)]
        assert elapsed < 2.0 and eng.errored
    finally:
        eng.shutdown()
        loop.close()


def test_exits_are_logged_by_what_caused_them(cfg, caplog):
    """A core that exits 0 (SIGTERM, as a sidecar's process group gets on Ctrl-C) asked to go: no
    ERROR; a core killed is an error. Both leave the engine dead for its callers."""
    for sig, level in ((signal.SIGTERM, "INFO"), (signal.SIGKILL, "ERROR")):
        eng = AsyncEngine(cfg)
        try:
            caplog.clear()
            with caplog.at_level("INFO", logger="engine.async_engine"):
                os.kill(eng.proc.pid, sig)
                deadline = time.monotonic() + 10
                while not eng.errored or not caplog.records:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            assert [(r.levelname, "exit code" in r.getMessage()) for r in caplog.records] == [(level, True)]
        finally:
            eng.shutdown()
    with caplog.at_level("INFO", logger="engine.async_engine"):
        caplog.clear()
        AsyncEngine(cfg).shutdown()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_shutdown_leaves_no_process(cfg):
    before = set(descendants())
    eng = AsyncEngine(cfg)
    assert eng.proc.pid in descendants()
    eng.shutdown()
    assert set(descendants()) - before == set()


def test_engines_one_after_another_in_one_loop(qwen2_dir):
    """A second engine started in the loop where the first was shut down gets its replies (the
    first's output socket must leave nothing registered that the second's could collide with)."""
    params = SamplingParams(temperature=0, max_tokens=4)

    async def run():
        outs = []
        for k in range(3):
            eng = AsyncEngine(EngineConfig(model=qwen2_dir, max_model_len=256))
            try:
                out = await asyncio.wait_for(_collect(eng, [5, 6, 7], params, f"seq{k}"), 60)
                outs.append(out.outputs[0].token_ids)
                assert (await asyncio.wait_for(eng.get_stats(), 30)) is not None
            finally:
                eng.shutdown()
        return outs

    outs = asyncio.run(run())
    assert len(outs) == 3 and outs[0] == outs[1] == outs[2] and len(outs[0]) == 4
