"""Returned logprobs equal log_softmax of the HF forward on prompt + completion, within what fp32
rounding explains (helpers.fp32_logprob_tolerance), whatever the thread counts on either side."""

import pytest

from engine import LLM, EngineConfig, SamplingParams
from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance, hf_logprobs, random_prompts, torch_threads


@pytest.fixture(scope="module")
def llm(qwen2_dir):
    return LLM(EngineConfig(model=qwen2_dir, max_num_seqs=32, max_model_len=256, block_size=8))


def _tolerance(model, prompt, completion, statistic="max"):
    return fp32_logprob_tolerance(model.config, activation_magnitude(model, prompt + completion), statistic)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("engine_threads,hf_threads", [(1, 2), (2, 1)])
def test_sampled_logprobs_match_hf_forward(qwen2_dir, hf_models, temperature, engine_threads, hf_threads):
    llm = LLM(EngineConfig(model=qwen2_dir, max_num_seqs=32, max_model_len=256, block_size=8,
                           num_threads=engine_threads))
    prompts = random_prompts(6, 4, 50, 2000, seed=10)
    params = SamplingParams(n=3, temperature=temperature, max_tokens=30, seed=7)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_models["qwen2"]
    with torch_threads(hf_threads):
        for p, o in zip(prompts, outs):
            for c in o.outputs:
                ref = hf_logprobs(hf, p, c.token_ids, temperature)
                tol = _tolerance(hf, p, c.token_ids)
                assert c.logprobs == pytest.approx(ref, abs=tol)
                assert c.cumulative_logprob == pytest.approx(sum(ref), abs=tol * len(ref))
                mean_diff = sum(abs(a - b) for a, b in zip(c.logprobs, ref)) / len(ref)
                assert mean_diff <= _tolerance(hf, p, c.token_ids, "mean")


def test_greedy_reports_raw_logprobs(llm, hf_models):
    p = random_prompts(1, 20, 20, 2000, seed=11)[0]
    c = llm.generate([p], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    hf = hf_models["qwen2"]
    assert c.logprobs == pytest.approx(hf_logprobs(hf, p, c.token_ids), abs=_tolerance(hf, p, c.token_ids))


def test_raw_logprobs_mode(qwen2_dir, hf_models):
    llm = LLM(EngineConfig(model=qwen2_dir, max_model_len=128, logprobs_mode="raw"))
    p = random_prompts(1, 12, 12, 2000, seed=12)[0]
    c = llm.generate([p], SamplingParams(temperature=0.5, max_tokens=12, seed=1), use_tqdm=False)[0].outputs[0]
    hf = hf_models["qwen2"]
    assert c.logprobs == pytest.approx(hf_logprobs(hf, p, c.token_ids, 1.0), abs=_tolerance(hf, p, c.token_ids))


def test_top_k_logprobs_are_renormalised(llm, hf_models):
    """Processed logprobs come from the top-k-truncated distribution: each >= the full one."""
    import math

    p = random_prompts(1, 16, 16, 2000, seed=13)[0]
    c = llm.generate([p], SamplingParams(temperature=1.0, top_k=5, max_tokens=15, seed=3), use_tqdm=False)
    c = c[0].outputs[0]
    full = hf_logprobs(hf_models["qwen2"], p, c.token_ids)
    tol = _tolerance(hf_models["qwen2"], p, c.token_ids)
    assert all(lp >= f - tol for lp, f in zip(c.logprobs, full))
    assert any(lp > f + 1e-3 for lp, f in zip(c.logprobs, full))
    assert all(lp <= 1e-6 and math.isfinite(lp) for lp in c.logprobs)
