"""Derived copies of the weights (engine/kernels/derived_weights.py: the prepacked linears) follow a push
without a forward paying for them: a push derives them from its staged weights while the engine
serves, its commit swaps them in, a delta derives only the tensors it changed, and a push that is
refused, dropped or cut by a dead trainer leaves the old copies serving. The engine is a real
AsyncEngine (its core process runs a worker extension that counts derivations); the trainer this
pytest process, or a real trainer process killed mid-push. Gloo on loopback, no mocks."""

import asyncio
import json
import os
import shutil
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.kernels import f32_linears, packed_linears
from tests.engine.helpers import random_prompts
from tests.weight_sync.derive_count_extension import served_copies
from tests.weight_sync.test_push import _Trainer
from weight_sync import WeightSender, WeightSyncError, weights_checksum
from weight_sync.common.manifest import Manifest
from weight_sync.engine_side.engines import commit_results, finish_on_engines, join_engines
from weight_sync.trainer.push import run_push

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not packed_linears.supported(torch.float32), reason="no oneDNN fp32 linear here")]

TIMEOUT_S = 20.0
EXTENSION = "tests.weight_sync.derive_count_extension:DeriveCountExtension"
PROMPTS = random_prompts(3, 4, 12, 500, seed=5)


@pytest.fixture(scope="module", autouse=True)
def packed_copies():
    """fp32 linears on a packed copy (the derived kind these tests follow), not on the weights in
    place (engine/kernels/f32_linears.py's default on AVX-512: nothing to derive); the engine cores inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(f32_linears.IN_PLACE_SWITCH, "0")
        yield


@pytest.fixture(scope="module")
def engine(qwen2_dir, loop, packed_copies):
    e = AsyncEngine(EngineConfig(model=qwen2_dir, max_num_seqs=4, max_model_len=128, kv_cache_memory_gb=0.05,
                                 worker_extension_cls=EXTENSION, prepack_linears=True))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def trainer(qwen2_dir):
    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sender():
    s = WeightSender(bucket_bytes=1 << 18, timeout_s=TIMEOUT_S)
    yield s
    s.close_group()


def run(loop, coro):
    return loop.run_until_complete(coro)


async def rpc(engine, method, *args):
    return (await engine.collective_rpc(method, args=args))[0]


@pytest.fixture
def group(engine, sender, loop):
    if sender.group is None or not sender.group.ready or not run(loop, rpc(engine, "weight_sync_info"))["ready"]:
        run(loop, _form(engine, sender))
    return sender.group


async def _form(engine, sender):
    info = sender.open_group(world_size=2, timeout_s=TIMEOUT_S)
    await asyncio.gather(asyncio.to_thread(sender.join_group), join_engines([engine], info, 1))


async def overlapped_push(engine, sender, weights, version, delta=False, anchor=False, commit=True):
    """A push as the sidecar makes one: staged on the engine's receiving thread while it serves
    (begin_receive_weights), then swapped in (finish_staged_weights), prefix cache reset, version tagged."""
    group_name = sender.group.group_name

    def deliver(m):
        wire = m.to_wire() if isinstance(m, Manifest) else m
        return [("engine 0", asyncio.ensure_future(engine.collective_rpc(
            "begin_receive_weights", args=(wire,), kwargs={"group_name": group_name})))]

    outcome = await run_push(sender, weights, version, deliver, TIMEOUT_S, delta=delta, anchor=anchor)
    staged = [r if isinstance(r, BaseException) else r[0] for r in outcome.results]
    results = await finish_on_engines([engine], staged, commit=commit)
    if not commit:
        return results
    trainer_error = outcome.trainer if isinstance(outcome.trainer, BaseException) else None
    out = await commit_results([engine], results, version, "push", trainer_error)
    out["trainer"] = outcome.trainer
    return out


async def greedy(engine, prompts=PROMPTS, n=10):
    outs = []
    for p in prompts:
        last = None
        async for out in engine.generate(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
            last = out
        outs.append(last.outputs[0].token_ids)
    return outs


def fresh_engine_greedy(qwen2_dir, trainer, tmp_path, prompts=PROMPTS, n=10, quantization="none"):
    """A fresh engine started on the trainer's weights saved as a checkpoint: its greedy tokens."""
    d = tmp_path / "checkpoint"
    shutil.copytree(qwen2_dir, d)
    trainer.save_pretrained(d)
    llm = LLM(EngineConfig(model=str(d), max_num_seqs=4, max_model_len=128, kv_cache_memory_gb=0.05,
                           prepack_linears=True, quantization=quantization))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def perturb(model, seed, names=None):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if names is None or n in names:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_a_full_push_derives_while_staged_and_the_first_forward_derives_nothing(engine, trainer, sender, group, loop,
                                                                                  qwen2_dir, tmp_path):
    run(loop, greedy(engine, PROMPTS[:1]))  # every copy made once
    run(loop, rpc(engine, "derive_count"))
    perturb(trainer, 1)
    out = run(loop, overlapped_push(engine, sender, trainer, 1))
    derived_while_staged = run(loop, rpc(engine, "derive_count"))
    assert derived_while_staged == served_copies(trainer)  # every copy, from the staged weights (lm_head tied or not)
    assert out["worker_results"][0]["derive_seconds"] > 0
    got = run(loop, greedy(engine))
    assert run(loop, rpc(engine, "derive_count")) == 0  # no forward after the commit derived anything
    assert run(loop, engine.collective_rpc("weights_checksum")) == [weights_checksum(trainer.named_parameters())]
    assert got == fresh_engine_greedy(qwen2_dir, trainer, tmp_path)


def test_a_delta_derives_only_what_it_changed(engine, trainer, sender, group, loop, qwen2_dir, tmp_path):
    run(loop, overlapped_push(engine, sender, trainer, 10, delta=True, anchor=True))
    run(loop, greedy(engine, PROMPTS[:1]))
    run(loop, rpc(engine, "derive_count"))
    changed = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    perturb(trainer, 11, changed)
    out = run(loop, overlapped_push(engine, sender, trainer, 11, delta=True))
    assert out["trainer"]["delta"]
    assert run(loop, rpc(engine, "derive_count")) == len(changed)
    got = run(loop, greedy(engine))
    assert run(loop, rpc(engine, "derive_count")) == 0
    assert run(loop, engine.collective_rpc("weights_checksum")) == [weights_checksum(trainer.named_parameters())]
    assert got == fresh_engine_greedy(qwen2_dir, trainer, tmp_path)


def test_a_commit_keeps_the_copies_it_replaced_as_the_next_pushs_memory(engine, trainer, sender, group, loop,
                                                                         qwen2_dir, tmp_path):
    """With the staging kept between pushes (the CPU default), the packed copies a commit retires are
    the memory the next push packs into: two sets of copies alternate, no fresh pages a push, and
    what is served is still the new weights' packs."""
    if not f32_linears.available():
        pytest.skip("the fp32 panels (the kind that takes a retired copy's memory) need AVX-512")
    run(loop, overlapped_push(engine, sender, trainer, 30))
    perturb(trainer, 31)
    run(loop, overlapped_push(engine, sender, trainer, 31))
    count = len(run(loop, rpc(engine, "derived_copy_ids")))
    first = run(loop, rpc(engine, "derived_copy_memory"))
    served_a, kept_a = first[:count], first[count:]
    assert all(served_a) and len(kept_a) == count  # a full set served, a full set kept
    perturb(trainer, 32)
    run(loop, overlapped_push(engine, sender, trainer, 32))
    second = run(loop, rpc(engine, "derived_copy_memory"))
    assert sorted(second[:count]) == sorted(kept_a) and sorted(second[count:]) == sorted(served_a)
    got = run(loop, greedy(engine))
    assert run(loop, engine.collective_rpc("weights_checksum")) == [weights_checksum(trainer.named_parameters())]
    assert got == fresh_engine_greedy(qwen2_dir, trainer, tmp_path)


def test_a_dropped_or_refused_push_leaves_the_old_copies_serving(engine, trainer, sender, group, loop):
    run(loop, overlapped_push(engine, sender, trainer, 20))
    before = run(loop, greedy(engine))
    copies, checksum = run(loop, rpc(engine, "derived_copy_ids")), run(loop, engine.collective_rpc("weights_checksum"))
    run(loop, rpc(engine, "derive_count"))
    # staged in full, copies derived, then dropped (as when another engine failed): nothing swapped in
    perturb(trainer, 21)
    assert run(loop, overlapped_push(engine, sender, trainer, 21, commit=False)) == [[{"dropped": 21}]]
    assert run(loop, rpc(engine, "derive_count")) == served_copies(trainer)  # made, never served
    # refused before any byte: a tensor of another shape
    bad = dict(trainer.named_parameters())
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(WeightSyncError) as err:
        run(loop, overlapped_push(engine, sender, bad, 22))
    assert err.value.refused
    assert run(loop, rpc(engine, "derived_copy_ids")) == copies
    assert run(loop, engine.collective_rpc("weights_checksum")) == checksum
    assert run(loop, greedy(engine)) == before
    assert run(loop, rpc(engine, "derive_count")) == 0


def test_a_trainer_killed_mid_push_leaves_the_old_weights_and_copies_serving(engine, sender, loop, qwen2_dir):
    sender.close_group()
    before = run(loop, greedy(engine))
    copies, checksum = run(loop, rpc(engine, "derived_copy_ids")), run(loop, engine.collective_rpc("weights_checksum"))
    assert all(copies)
    run(loop, rpc(engine, "derive_count"))
    proc = _Trainer(qwen2_dir, "stall", world_size=2, timeout_s=TIMEOUT_S)
    try:
        async def scenario():
            info = (await proc.next("info"))["info"]
            await join_engines([engine], info, 1)
            manifest = json.loads((await proc.next("manifest"))["manifest"])
            staging = asyncio.ensure_future(engine.collective_rpc("begin_receive_weights", args=(manifest,)))
            await proc.next("stalled")
            assert await greedy(engine, PROMPTS[:1]) == before[:1]  # served meanwhile, on the old copies
            os.kill(proc.proc.pid, signal.SIGKILL)
            return (await asyncio.wait_for(staging, TIMEOUT_S))[0]

        assert run(loop, scenario()) == "failed"
    finally:
        proc.close()
    with pytest.raises(RuntimeError, match="Nothing was committed"):
        run(loop, engine.collective_rpc("finish_staged_weights", args=(True,)))
    assert run(loop, rpc(engine, "derived_copy_ids")) == copies
    assert run(loop, engine.collective_rpc("weights_checksum")) == checksum
    assert run(loop, greedy(engine)) == before
    assert run(loop, rpc(engine, "derive_count")) == 0


def test_an_engine_that_reserves_its_staging_reserves_its_derived_copies_memory_too(qwen2_dir, trainer, loop):
    """EngineConfig.reserve_push_staging (a sidecar's engine): a full set of spare copies from the start
    (derived_weights.reserve_spares), and the first push's copies derived into that memory (its pages
    there already, as every later push's are), serving the pushed weights."""
    if not f32_linears.available():
        pytest.skip("the fp32 panels (the kind that takes a retired copy's memory) need AVX-512 or AVX2")
    e = AsyncEngine(EngineConfig(model=qwen2_dir, max_num_seqs=4, max_model_len=128, kv_cache_memory_gb=0.05,
                                 worker_extension_cls=EXTENSION, prepack_linears=True, reserve_push_staging=True))
    s = WeightSender(bucket_bytes=1 << 18, timeout_s=TIMEOUT_S)
    try:
        count = len(run(loop, rpc(e, "derived_copy_ids")))
        start = run(loop, rpc(e, "derived_copy_memory"))
        served, kept = start[:count], start[count:]
        assert all(served) and len(kept) == count and all(kept)  # a full set served, a full set reserved
        run(loop, _form(e, s))
        perturb(trainer, 40)
        run(loop, overlapped_push(e, s, trainer, 1))
        after = run(loop, rpc(e, "derived_copy_memory"))
        assert sorted(after[:count]) == sorted(kept) and sorted(after[count:]) == sorted(served)
        assert run(loop, e.collective_rpc("weights_checksum")) == [weights_checksum(trainer.named_parameters())]
    finally:
        s.close_group()
        e.shutdown()
