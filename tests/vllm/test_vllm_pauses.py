"""A real vLLM engine (its core and worker processes) driven in process by the adapter and by the
rollout manager: pauses, version tags, streamed groups, and the transports of a push other than
the sidecar's overlapped broadcast (in place, shared memory, files). One engine for the module."""

import asyncio
import copy
import os

import pytest

pytest.importorskip("vllm")

from engine import EngineConfig, SamplingParams  # noqa: E402
from rollout.sidecar.group_stream import stream_group  # noqa: E402
from rollout.sidecar.manager import RolloutManager  # noqa: E402
from tests.engine.helpers import random_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(qwen2_dir, loop):
    from engine.vllm_engine import VllmEngine
    from engine.vllm_start import apply_env_defaults

    applied = apply_env_defaults("cpu", 1, "WARNING")  # undone below: later sidecars (TP 2) inherit os.environ
    from weight_sync.vllm.extension import VLLM_EXTENSION

    e = VllmEngine(EngineConfig(model=qwen2_dir, max_model_len=256, gpu_memory_utilization=0.3,
                                worker_extension_cls=VLLM_EXTENSION))
    yield e

    async def stop():  # in the loop: vLLM's shutdown cancels its tasks there, before the loop closes
        e.shutdown()
        await asyncio.sleep(0.1)

    loop.run_until_complete(stop())
    for name in applied:
        os.environ.pop(name, None)


class _Reader:
    """Reads one request's delta stream, only while `gate` is set (tokens pile up meanwhile)."""

    def __init__(self, engine, prompt, rid, gate, max_tokens):
        self.tokens, self.versions, self.finish = [], [], None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind="delta")
        self.task = asyncio.ensure_future(self._read(engine.generate(prompt, params, request_id=rid), gate))

    async def _read(self, stream, gate):
        while True:
            await gate.wait()
            try:
                out = await stream.__anext__()
            except StopAsyncIteration:
                return
            c = out.outputs[0]
            self.tokens += c.token_ids
            self.versions += c.weight_versions
            self.finish = c.finish_reason


async def _until(cond, timeout=60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


# Tokens a request of the pause test asks for: more than vLLM samples in the ~0.5 s the test leaves
# them unread before it pauses (80 were all sampled by then once, on a fast run of this machine).
PILED_REQUEST_TOKENS = 240


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_tokens_sampled_before_a_pause_keep_their_version_however_late_they_are_read(engine, loop, mode):
    """Tags are the core's, not the reader's: tokens that pile up unread across pause +
    set_weight_version carry the old version, every token sampled after resume the new one."""
    async def run():
        old = engine.version
        gate = asyncio.Event()
        gate.set()
        readers = [_Reader(engine, p, f"{mode}{i}", gate, PILED_REQUEST_TOKENS)
                   for i, p in enumerate(random_prompts(4, 5, 10, 2000))]
        await _until(lambda: all(len(r.tokens) >= 3 for r in readers))
        gate.clear()  # stop reading: what the engine samples now piles up
        before = [len(r.tokens) for r in readers]
        await asyncio.sleep(0.5)
        await engine.pause_generation(mode=mode, clear_cache=False)
        await engine.set_weight_version(old + 1)
        gate.set()  # the piled-up tokens are read only now, after the version changed
        await asyncio.sleep(0.5)
        at_resume = [len(r.tokens) for r in readers]
        await engine.resume_generation()
        await asyncio.gather(*(r.task for r in readers))
        return readers, before, at_resume, old

    readers, before, at_resume, old = loop.run_until_complete(run())
    assert sum(at_resume) > sum(before)  # tokens did pile up unread across the version change
    for r, k in zip(readers, at_resume):
        assert 3 <= k < PILED_REQUEST_TOKENS
        if mode == "keep":  # frozen, then continued under the new version
            assert r.finish == "length" and r.versions == [old] * k + [old + 1] * (PILED_REQUEST_TOKENS - k)
        else:  # cut at the pause: every token it got was sampled before
            assert r.finish == "abort" and r.versions == [old] * k


# Tokens each rollout of the test under load asks for: enough that the rollouts outlast the first
# pause at 0.4 s (24 of 40 tokens all ended before it once, on a fast run of this machine: then no
# rollout spanned a version).
UNDER_LOAD_TOKENS = 160


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pauses_under_load_return_every_rollout_whole(engine, loop, mode):
    """The manager's pauses (a version change each, no weight change) under load: abort-mode cuts
    are resubmitted, wait mode lets each request end under one version, keep mode continues them."""
    manager = RolloutManager([engine], pause_mode=mode)
    prompts = random_prompts(6, 5, 30, 2000, seed=34)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=UNDER_LOAD_TOKENS, ignore_eos=True)

    async def bump(version):
        await engine.set_weight_version(version)
        manager.state.committed(version)

    async def run():
        base = engine.version
        groups = asyncio.gather(*(manager.generate_group(p, params) for p in prompts))
        for k in range(1, 4):
            await asyncio.sleep(0.4)
            await manager.run_paused(mode, lambda v=base + k: bump(v))
        out = await groups
        await manager.supervisor.close()
        return out, base

    groups, base = loop.run_until_complete(run())
    rollouts = [r for g in groups for r in g]
    assert len(rollouts) == 24 and all(sorted(r.index for r in g) == [0, 1, 2, 3] for g in groups)
    for r in rollouts:
        assert len(r.token_ids) == len(r.logprobs) == len(r.weight_versions) == UNDER_LOAD_TOKENS and r.finish_reason == "length"
        assert all(a <= b for a, b in zip(r.weight_versions, r.weight_versions[1:]))
        assert base <= r.weight_versions[0] and r.weight_versions[-1] <= base + 3
        if mode == "wait":  # every request ends before the pause it was submitted before
            assert len(set(r.weight_versions)) == 1
    spanning = [r for r in rollouts if len(set(r.weight_versions)) > 1]
    if mode == "abort":
        assert manager.counters["aborted_resubmitted"] > 0 and spanning
    if mode == "keep":
        assert spanning and manager.counters["aborted_resubmitted"] == 0


def test_a_streamed_group_hands_out_each_samples_end_once(engine, loop):
    """The HTTP front's path: samples of one group end at different steps, each exactly once."""
    manager = RolloutManager([engine])
    params = SamplingParams(n=8, temperature=1.0, max_tokens=60, stop_token_ids=list(range(100, 400)))

    async def run():
        deltas = [d async for d in stream_group(manager, [5, 6, 7, 8], params)]
        await manager.supervisor.close()
        return deltas

    deltas = loop.run_until_complete(run())
    ends = [d.index for d in deltas if d.finish_reason]
    lengths = [sum(len(d.token_ids) for d in deltas if d.index == i) for i in range(8)]
    assert sorted(ends) == list(range(8)) and len(set(lengths)) > 1  # ended at different steps


def test_stop_strings_end_the_text_before_them(engine, loop):
    """As our engine: the text ends before the stop string, the token that completed it is kept."""
    params = SamplingParams(n=4, temperature=1.0, max_tokens=40, stop=["a"])

    async def run():
        out = None
        async for out in engine.generate([5, 6, 7, 8], params, request_id="stops"):
            pass
        return out

    out = loop.run_until_complete(run())
    stopped = [c for c in out.outputs if c.finish_reason == "stop"]
    assert stopped  # "a" is in most of the tiny vocabulary's words
    for c in stopped:
        whole = engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.stop_reason == "a" and "a" not in c.text and whole.startswith(c.text) and "a" in whole
        assert len(c.logprobs) == len(c.weight_versions) == len(c.token_ids)


# -- the transports of a push ----------------------------------------------------------------------
def _greedy(engine, loop, prompt=(9, 10, 11), n=8):
    async def run():
        async for out in engine.generate(list(prompt), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
            pass
        return out.outputs[0].token_ids
    return loop.run_until_complete(run())


def test_in_place_shared_memory_and_file_pushes_serve_the_pushed_weights(engine, loop, hf_models, tmp_path):
    from tests.engine.helpers import hf_greedy
    from tests.rollout.test_sidecar import perturb
    from weight_sync import WeightSender, WeightSyncError, flatten_parameters
    from weight_sync.engine_side.engines import _deliveries, commit_results, engines_checksums, load_on_engines
    from weight_sync.trainer.file_push import write_safetensors
    from weight_sync.trainer.local_engines import init_weight_sync, push_shared_to_engines
    from weight_sync.trainer.push import run_push

    trainer = copy.deepcopy(hf_models["qwen2"])
    sender = WeightSender(bucket_bytes=1 << 20, timeout_s=20)
    loop.run_until_complete(init_weight_sync([engine], sender))

    async def in_place(version):
        deliver = lambda m: _deliveries([engine], m, 60, sender.group.group_name, "receive_weights_inplace")  # noqa: E731
        outcome = await run_push(sender, trainer, version, deliver, 60)
        return await commit_results([engine], outcome.results, version)

    # in place: straight into vLLM's loaders bucket by bucket; nothing kept to checksum
    perturb(trainer, 21, scale=0.05)
    out = loop.run_until_complete(in_place(31))
    assert out["worker_results"][0]["transport"] == "broadcast, in place"
    assert _greedy(engine, loop) == hf_greedy(trainer, [9, 10, 11], 8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="in-place push"):
        loop.run_until_complete(engines_checksums([engine]))
    # shared memory (weight_sync.trainer.shared_memory): no group
    flatten_parameters(trainer, shared=True)
    perturb(trainer, 22, scale=0.05)
    loop.run_until_complete(push_shared_to_engines([engine], sender, trainer, 32))
    assert loop.run_until_complete(engines_checksums([engine])) == [sender.checksum(trainer)]
    assert _greedy(engine, loop) == hf_greedy(trainer, [9, 10, 11], 8, ignore_eos=True)
    # files (the fallback, and how a restarted engine catches up): a bad file changes nothing
    good = copy.deepcopy(trainer)
    perturb(good, 23, scale=0.05)
    write_safetensors(good, tmp_path / "v33", version=33)
    bad = [(n, p.detach()[:-1] if n.endswith("norm.weight") else p.detach()) for n, p in good.named_parameters()]
    write_safetensors(bad, tmp_path / "bad", version=34)
    with pytest.raises(WeightSyncError, match="wrong shapes"):
        loop.run_until_complete(load_on_engines([engine], str(tmp_path / "bad"), version=34))
    assert loop.run_until_complete(engines_checksums([engine])) == [sender.checksum(trainer)]
    loop.run_until_complete(load_on_engines([engine], str(tmp_path / "v33"), version=33))
    assert loop.run_until_complete(engines_checksums([engine])) == [sender.checksum(good)]
    assert _greedy(engine, loop) == hf_greedy(good, [9, 10, 11], 8, ignore_eos=True)


def test_an_adapter_push_is_refused_by_name_and_changes_nothing(engine, loop, hf_models):
    from peft import LoraConfig, get_peft_model

    from weight_sync import WeightSender, WeightSyncError
    from weight_sync.trainer.local_engines import init_weight_sync, push_to_engines

    before = _greedy(engine, loop)
    peft = get_peft_model(copy.deepcopy(hf_models["qwen2"]), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    sender = WeightSender(bucket_bytes=1 << 20, timeout_s=20)
    loop.run_until_complete(init_weight_sync([engine], sender))
    with pytest.raises(WeightSyncError, match="mode='merged'") as e:
        loop.run_until_complete(push_to_engines([engine], sender, peft, version=40))
    assert e.value.refused
    assert _greedy(engine, loop) == before
    sender.close_group()


def test_bad_control_calls_fail_alone_and_the_engine_serves_on(engine, loop):
    before = _greedy(engine, loop)
    with pytest.raises(RuntimeError, match="no_such_method"):
        loop.run_until_complete(engine.collective_rpc("no_such_method"))
    with pytest.raises(ValueError, match="bogus"):  # a TypeError in the worker: the caller's fault
        loop.run_until_complete(engine.collective_rpc("weights_checksum", kwargs={"bogus": 1}))
    with pytest.raises(ValueError, match="pause mode"):
        loop.run_until_complete(engine.pause_generation(mode="sideways"))
    assert _greedy(engine, loop) == before
