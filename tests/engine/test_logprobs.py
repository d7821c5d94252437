"""Returned logprobs equal log_softmax of the HF forward on prompt + completion (fp32, 1e-4)."""

import pytest

from engine import LLM, EngineConfig, SamplingParams
from tests.engine.helpers import hf_logprobs, random_prompts


@pytest.fixture(scope="module")
def llm(qwen2_dir):
    return LLM(EngineConfig(model=qwen2_dir, max_num_seqs=32, max_model_len=256, block_size=8))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_hf_forward(llm, hf_models, temperature):
    prompts = random_prompts(6, 4, 50, 2000, seed=10)
    params = SamplingParams(n=3, temperature=temperature, max_tokens=30, seed=7)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            ref = hf_logprobs(hf_models["qwen2"], p, c.token_ids, temperature)
            assert c.logprobs == pytest.approx(ref, abs=1e-4)
            assert c.cumulative_logprob == pytest.approx(sum(ref), abs=1e-3)


def test_greedy_reports_raw_logprobs(llm, hf_models):
    p = random_prompts(1, 20, 20, 2000, seed=11)[0]
    c = llm.generate([p], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert c.logprobs == pytest.approx(hf_logprobs(hf_models["qwen2"], p, c.token_ids), abs=1e-4)


def test_raw_logprobs_mode(qwen2_dir, hf_models):
    llm = LLM(EngineConfig(model=qwen2_dir, max_model_len=128, logprobs_mode="raw"))
    p = random_prompts(1, 12, 12, 2000, seed=12)[0]
    c = llm.generate([p], SamplingParams(temperature=0.5, max_tokens=12, seed=1), use_tqdm=False)[0].outputs[0]
    assert c.logprobs == pytest.approx(hf_logprobs(hf_models["qwen2"], p, c.token_ids, 1.0), abs=1e-4)


def test_top_k_logprobs_are_renormalised(llm, hf_models):
    """Processed logprobs come from the top-k-truncated distribution: each >= the full one."""
    import math

    p = random_prompts(1, 16, 16, 2000, seed=13)[0]
    c = llm.generate([p], SamplingParams(temperature=1.0, top_k=5, max_tokens=15, seed=3), use_tqdm=False)
    c = c[0].outputs[0]
    full = hf_logprobs(hf_models["qwen2"], p, c.token_ids)
    assert all(lp >= f - 1e-5 for lp, f in zip(c.logprobs, full))
    assert any(lp > f + 1e-3 for lp, f in zip(c.logprobs, full))
    assert all(lp <= 1e-6 and math.isfinite(lp) for lp in c.logprobs)
