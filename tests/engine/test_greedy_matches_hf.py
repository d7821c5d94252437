"""Greedy output equals HF `generate` token for token, each prompt against HF run alone."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, memory_profile
from tests.engine.helpers import hf_greedy, random_prompts

ARCHS = ["qwen2", "llama"]


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_mixed_lengths(arch, model_dirs, hf_models):
    llm = LLM(EngineConfig(model=model_dirs[arch], max_num_seqs=16, max_model_len=256))
    prompts = random_prompts(10, 3, 70, 2000, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 24)


@pytest.mark.parametrize("arch", ARCHS)
def test_groups_sharing_a_prefix(arch, model_dirs, hf_models):
    llm = LLM(EngineConfig(model=model_dirs[arch], max_num_seqs=32, max_model_len=256, block_size=8))
    prefix = random_prompts(1, 40, 40, 2000, seed=2)[0]
    tails = random_prompts(4, 1, 12, 2000, seed=3)
    prompts = [prefix + t for t in tails] + [prefix]
    params = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.core.block_manager.prefix_hits > 0
    for p, o in zip(prompts, outs):
        ref = hf_greedy(hf_models[arch], p, 20, ignore_eos=True)
        assert [c.token_ids for c in o.outputs] == [ref] * 3


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_keeps_outputs_exact(arch, model_dirs, hf_models):
    # 12 blocks of 8 tokens = 96 slots for 8 sequences that grow to ~60 tokens: preemption must happen
    cfg = EngineConfig(model=model_dirs[arch], max_num_seqs=8, max_model_len=96, block_size=8, num_kv_blocks=12)
    llm = LLM(cfg)
    prompts = random_prompts(8, 10, 30, 2000, seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 32, ignore_eos=True)


def test_eos_ends_like_hf(eos_model_dir):
    """Without ignore_eos the engine stops where HF stops (EOS included in token_ids)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(eos_model_dir, dtype=torch.float32).eval()
    eos = set(hf.generation_config.eos_token_id)
    llm = LLM(EngineConfig(model=eos_model_dir, max_model_len=256))
    prompts = random_prompts(1, 10, 10, 2000, seed=99) + random_prompts(11, 5, 40, 2000, seed=98)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    reasons = []
    for p, o in zip(prompts, outs):
        ref = hf_greedy(hf, p, 40)
        c = o.outputs[0]
        assert c.token_ids == ref
        assert c.finish_reason == ("stop" if ref[-1] in eos else "length")
        reasons.append(c.finish_reason)
    assert "stop" in reasons


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["fresh", "cached-prefixes"])
def test_padded_prefill_matches_hf(prefix_caching, model_dirs, hf_models, monkeypatch):
    """The GPU's prefill path (the step's spans padded into one attention call per layer),
    forced on the CPU, with fresh prompts and with prompts that extend a cached prefix (a GRPO
    group): greedy equal to HF, and the per-span path's logprobs within rounding."""
    from engine import step_inputs
    from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance

    prompts = random_prompts(6, 3, 40, 2000, seed=77)
    if prefix_caching:
        prompts += [p[: len(p) // 2] + [5, 6, 7] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    monkeypatch.setattr(step_inputs, "padded_layout",  # records into the current iteration's `layouts`
                        lambda *a, f=step_inputs.padded_layout: layouts.append(f(*a)) or layouts[-1])
    for padded in (True, False):
        llm = LLM(EngineConfig(model=model_dirs["qwen2"], max_num_seqs=8, max_model_len=128, block_size=4,
                               enable_prefix_caching=prefix_caching))
        runner = llm.core.runner
        runner.padded_prefill = padded
        layouts = []  # the padded layouts the steps took (None: that step fell back to per-span calls)
        if prefix_caching:  # the first prompts fill the cache; the rest reuse their prefixes
            llm.generate(prompts[:6], params, use_tqdm=False)
        results.append(llm.generate(prompts, params, use_tqdm=False))
        assert any(x is not None for x in layouts) if padded else layouts == []
    padded, plain = results
    hf = hf_models["qwen2"]
    for p, a, b in zip(prompts, padded, plain):
        assert a.outputs[0].token_ids == hf_greedy(hf, p, 12, ignore_eos=True) == b.outputs[0].token_ids
        tol = fp32_logprob_tolerance(hf.config, activation_magnitude(hf, p + a.outputs[0].token_ids))
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=tol)


def test_the_profile_step_runs_the_largest_step_and_leaves_the_cache_alone(model_dirs):
    """The start-up profile (what a GPU's KV budget subtracts) on the CPU: the largest prefill
    and sample run on a scratch cache; the engine's cache and its answers are as before."""
    llm = LLM(EngineConfig(model=model_dirs["qwen2"], max_num_seqs=8, max_model_len=128, max_num_batched_tokens=300))
    runner = llm.core.runner
    runner.padded_prefill = True
    prompt = random_prompts(1, 10, 10, 2000, seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    cache = runner.k_cache.clone()
    memory_profile.profile_step(runner)
    assert torch.equal(runner.k_cache, cache)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == before
