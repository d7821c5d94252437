"""Delta pushes end to end (weight_sync/common/delta_push.py): the trainer is this pytest process, the
engines real AsyncEngines (one serving bf16, one fp32) fed bf16 over one gloo group. A delta gives
bit for bit what a full push gives; a base the engines do not hold is refused before any byte and
the push goes in full; a push whose bytes are not the ones meant (a chunk never filled, a chunk
altered in flight, a delta patched onto other weights) commits nowhere."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import AsyncEngine, EngineConfig, SamplingParams
from tests.engine.helpers import hf_greedy, random_prompts
from weight_sync import EXTENSION, WeightSender, WeightSyncError, weights_checksum
from weight_sync.engine_side.engines import engines_checksums, join_engines
from weight_sync.trainer.local_engines import push_to_engines

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S = 20.0


def bf16_and_fp32_engines(model_dir: str):
    """A bf16 and an fp32 AsyncEngine on `model_dir`, with the weight-sync extension; shut down after."""
    made = [AsyncEngine(EngineConfig(model=model_dir, max_num_seqs=4, max_model_len=128, kv_cache_memory_gb=0.05,
                                     worker_extension_cls=EXTENSION, dtype=dtype))
            for dtype in ("bfloat16", "float32")]
    try:
        yield made
    finally:
        for e in made:
            e.shutdown()


@pytest.fixture(scope="module")
def engines(qwen2_dir, loop):
    yield from bf16_and_fp32_engines(qwen2_dir)


@pytest.fixture(scope="module")
def trainer(qwen2_dir):
    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sender():
    s = WeightSender(bucket_bytes=1 << 18, timeout_s=TIMEOUT_S, dtype=torch.bfloat16)
    yield s
    s.close_group()


def run(loop, coro):
    return loop.run_until_complete(coro)


async def gather(*aws):
    return await asyncio.gather(*aws)


async def _form(engines, sender):
    info = sender.open_group(world_size=1 + len(engines), timeout_s=TIMEOUT_S)
    await asyncio.gather(asyncio.to_thread(sender.join_group),
                         *(join_engines([e], info, 1 + i) for i, e in enumerate(engines)))


@pytest.fixture
def group(engines, sender, loop):
    infos = run(loop, gather(*(e.collective_rpc("weight_sync_info") for e in engines)))
    if not (sender.group is not None and sender.group.ready and all(i[0]["ready"] for i in infos)):
        run(loop, _form(engines, sender))
    return sender.group


def step(model, seed, frac=0.03, scale=0.01):
    """An optimizer step's shape: a few percent of the elements move, the rest not at all."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=g) < frac
            p.add_(torch.randn(p.shape, generator=g) * scale * mask)


def served(model) -> list[str]:
    """What the bf16 engine and the fp32 engine hold after a bf16 push of `model`."""
    bf16 = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
    return [weights_checksum(bf16), weights_checksum((n, t.float()) for n, t in bf16)]


def full_then_delta_land_exactly(engines, sender, trainer, loop) -> None:
    """A bf16 full push (an anchor), then a delta after a small step: each lands bit for bit in the
    bf16 engine and the fp32 one (`bf16_and_fp32_engines`), and the fp32 engine then decodes as HF
    does on the pushed (bf16-rounded) weights."""
    step(trainer, seed=1, frac=1.0)
    run(loop, push_to_engines(engines, sender, trainer, 1, delta=None, anchor=True))
    assert run(loop, engines_checksums(engines)) == served(trainer)
    step(trainer, seed=2)
    out = run(loop, push_to_engines(engines, sender, trainer, 2, delta=None))
    assert out["trainer"]["delta"] and run(loop, engines_checksums(engines)) == served(trainer)
    ref = AutoModelForCausalLM.from_config(trainer.config).eval()
    ref.load_state_dict({n: p.to(torch.bfloat16).float() for n, p in trainer.state_dict().items()})
    prompts = random_prompts(2, 4, 12, 500, seed=3)
    assert [run(loop, _greedy(engines[1], p, 10)) for p in prompts] == [hf_greedy(ref, p, 10, ignore_eos=True)
                                                                  for p in prompts]


async def _greedy(engine, prompt, n=12):
    last = None
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
        last = out
    return last.outputs[0].token_ids


def _anchor(engines, trainer, sender, loop, version):
    out = run(loop, push_to_engines(engines, sender, trainer, version, delta=None, anchor=True))
    assert not out["trainer"]["delta"] and sender.kept is not None and sender.kept.version == version
    return out


def test_a_delta_gives_bit_for_bit_what_a_full_push_gives(engines, trainer, sender, group, loop):
    _anchor(engines, trainer, sender, loop, 1)
    assert run(loop, engines_checksums(engines)) == served(trainer)
    step(trainer, seed=2)
    out = run(loop, push_to_engines(engines, sender, trainer, 2, delta=None))
    t = out["trainer"]
    assert t["delta"] and t["bytes"] < 0.25 * t["full_bytes"]  # ~3% changed: positions + values
    assert run(loop, engines_checksums(engines)) == served(trainer)
    assert all(r["delta"] and r["bytes"] == t["bytes"] for r in out["worker_results"])
    by_delta = [[run(loop, _greedy(e, p)) for p in random_prompts(3, 4, 12, 500, seed=5)] for e in engines]

    # the same weights pushed in full: the same bits, the same tokens
    full = run(loop, push_to_engines(engines, sender, trainer, 3, anchor=True))
    assert not full["trainer"]["delta"] and run(loop, engines_checksums(engines)) == served(trainer)
    assert by_delta == [[run(loop, _greedy(e, p)) for p in random_prompts(3, 4, 12, 500, seed=5)] for e in engines]
    # and the fp32 engine's tokens are HF's on those weights
    ref = AutoModelForCausalLM.from_config(trainer.config).eval()
    ref.load_state_dict({n: p.to(torch.bfloat16).float() for n, p in trainer.state_dict().items()})
    assert by_delta[1] == [hf_greedy(ref, p, 12, ignore_eos=True) for p in random_prompts(3, 4, 12, 500, seed=5)]


def test_deltas_chain_and_nothing_changed_sends_nothing(engines, trainer, sender, group, loop):
    _anchor(engines, trainer, sender, loop, 10)
    for version in (11, 12, 13):
        step(trainer, seed=version)
        out = run(loop, push_to_engines(engines, sender, trainer, version, delta=None))
        assert out["trainer"]["delta"] and run(loop, engines_checksums(engines)) == served(trainer)
    out = run(loop, push_to_engines(engines, sender, trainer, 14, delta=None))  # no step: no element changed
    assert out["trainer"]["delta"] and out["trainer"]["bytes"] == 0
    assert run(loop, engines_checksums(engines)) == served(trainer)


def test_auto_sends_the_full_weights_when_a_delta_is_not_smaller(engines, trainer, sender, group, loop):
    _anchor(engines, trainer, sender, loop, 20)
    step(trainer, seed=21, frac=1.0, scale=0.05)  # every element moves
    out = run(loop, push_to_engines(engines, sender, trainer, 21, delta=None))
    assert not out["trainer"]["delta"] and out["trainer"]["bytes"] == out["trainer"]["full_bytes"]
    step(trainer, seed=22, frac=1.0, scale=0.05)
    forced = run(loop, push_to_engines(engines, sender, trainer, 22, delta=True))  # forced: every tensor as "full"
    assert forced["trainer"]["delta"] and run(loop, engines_checksums(engines)) == served(trainer)


def test_an_engine_without_the_base_refuses_and_the_push_goes_in_full(engines, trainer, sender, group, loop):
    _anchor(engines, trainer, sender, loop, 30)
    # the bf16 engine's weights go back to the checkpoint's (sleep level 2 frees them, wake_up reloads)
    run(loop, engines[0].sleep(level=2))
    run(loop, engines[0].wake_up())
    step(trainer, seed=31)
    out = run(loop, push_to_engines(engines, sender, trainer, 31, delta=None))
    assert not out["trainer"]["delta"]  # refused before any byte, then sent in full to both
    assert run(loop, engines_checksums(engines)) == served(trainer)
    step(trainer, seed=32)  # and the chain goes on from there
    assert run(loop, push_to_engines(engines, sender, trainer, 32, delta=None))["trainer"]["delta"]
    assert run(loop, engines_checksums(engines)) == served(trainer)


def test_a_base_one_version_old_is_refused(engines, trainer, sender, group, loop):
    """Engine 1 misses version 41 (pushed to engine 0 alone): the delta on 41 is refused by it
    before any byte, and both get version 42 in full."""
    _anchor(engines, trainer, sender, loop, 40)
    step(trainer, seed=41)
    run(loop, _form(engines[:1], sender))
    assert run(loop, push_to_engines(engines[:1], sender, trainer, 41, delta=None))["trainer"]["delta"]
    run(loop, _form(engines, sender))
    step(trainer, seed=42)
    out = run(loop, push_to_engines(engines, sender, trainer, 42, delta=None))
    assert not out["trainer"]["delta"] and run(loop, engines_checksums(engines)) == served(trainer)


# -- no silent success: bytes that are not the ones meant never commit -----------------------------
def _sabotaged(sender, alter):
    """The trainer's group sends `alter(bytes)` for its first bucket instead of the bytes (which it
    still hashes as meant): a fault between the trainer's memory and the workers'."""
    g = sender.group
    real, sent = g.fan_out, []

    def fan_out(t):
        if not sent:
            sent.append(True)
            t = alter(t.clone())
        return real(t)

    g.fan_out = fan_out


def _unchanged_after_failing(engines, trainer, sender, loop, version, **kw):
    before = run(loop, engines_checksums(engines))
    with pytest.raises(WeightSyncError, match="not the ones the trainer sent"):
        run(loop, push_to_engines(engines, sender, trainer, version, **kw))
    assert run(loop, engines_checksums(engines)) == before
    assert run(loop, gather(*(_greedy(e, [3, 4, 5], 2) for e in engines)))  # both still serve


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
@pytest.mark.parametrize("fault", ["chunk never filled", "chunk altered"])
def test_a_push_whose_bytes_are_not_the_ones_sent_commits_nowhere(engines, trainer, sender, group, loop, fault,
                                                                  delta):
    _anchor(engines, trainer, sender, loop, 50)
    step(trainer, seed=51)
    if fault == "chunk never filled":
        _sabotaged(sender, lambda t: t.zero_())
    else:
        _sabotaged(sender, lambda t: t.view(-1)[t.numel() // 2:t.numel() // 2 + 1].add_(1))
    _unchanged_after_failing(engines, trainer, sender, loop, 51, delta=delta or None, anchor=not delta)
    run(loop, _form(engines, sender))  # the failed push closed the group
    assert sender.kept.version == 50  # the failed push is no base
    out = run(loop, push_to_engines(engines, sender, trainer, 51, delta=None))
    assert out["trainer"]["delta"] and run(loop, engines_checksums(engines)) == served(trainer)


def test_a_delta_patched_onto_other_weights_commits_nowhere(engines, trainer, sender, group, loop):
    """The trainer's idea of the base is wrong where the step changed an element (its kept copy
    already holds the new value there): the delta leaves that element out, the engines' result is
    not the trainer's weights, and the commit vote stops it."""
    _anchor(engines, trainer, sender, loop, 60)
    step(trainer, seed=61)
    name, p = next((n, p) for n, p in trainer.named_parameters() if p.dim() == 2)
    kept = sender.kept.tensors[name].view(-1)
    new = p.detach().to(torch.bfloat16).view(-1)
    i = int((kept.view(torch.int16) != new.view(torch.int16)).nonzero()[0])
    kept[i] = new[i]
    _unchanged_after_failing(engines, trainer, sender, loop, 61, delta=True)
    run(loop, _form(engines, sender))
    _anchor(engines, trainer, sender, loop, 62)
    assert run(loop, engines_checksums(engines)) == served(trainer)
