"""vLLM's sampling options through the whole engine, against HF: penalties, min_p, top
logprobs (logprobs=k) and prompt logprobs."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance, random_prompts


@pytest.fixture(scope="module")
def llm(qwen2_dir):
    return LLM(EngineConfig(model=qwen2_dir, max_num_seqs=16, max_model_len=256, block_size=8))


def _hf_rows(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the HF forward at every position of `ids`."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _tolerance(model, ids):
    return fp32_logprob_tolerance(model.config, activation_magnitude(model, ids))


def test_greedy_with_repetition_penalty_matches_hf_generate(llm, hf_models):
    hf = hf_models["qwen2"]
    changed = 0
    for p in random_prompts(3, 5, 30, 2000, seed=30):
        params = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5, ignore_eos=True)
        ours = llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
        with torch.inference_mode():
            theirs = hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 repetition_penalty=1.5)[0, len(p):].tolist()
        assert ours == theirs
        params.repetition_penalty = 1.0
        changed += llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids != ours
    assert changed, "the penalty changed nothing on these prompts: pick others"


def test_greedy_with_presence_and_frequency_penalties_follows_the_reference(llm, hf_models):
    """No HF processor has OpenAI's penalties: the reference is a greedy loop over HF forwards
    with the penalties subtracted by hand (output tokens only)."""
    hf = hf_models["qwen2"]
    p = random_prompts(1, 12, 12, 2000, seed=31)[0]
    ours = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, presence_penalty=1.5,
                                            frequency_penalty=1.0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    out: list[int] = []
    for _ in range(16):
        with torch.inference_mode():
            logits = hf(torch.tensor([p + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        out.append(int((logits - 1.0 * counts - 1.5 * (counts > 0).float()).argmax()))
    assert ours.token_ids == out
    plain = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert plain[0].outputs[0].token_ids != out, "the penalties changed nothing here: pick another prompt"


def test_min_p_samples_only_tokens_above_the_floor(llm, hf_models):
    hf = hf_models["qwen2"]
    p = random_prompts(1, 10, 10, 2000, seed=32)[0]
    outs = llm.generate([p], SamplingParams(n=4, temperature=1.5, min_p=0.2, max_tokens=12, seed=5), use_tqdm=False)
    for c in outs[0].outputs:
        rows = _hf_rows(hf, p + c.token_ids)[len(p) - 1 : -1] / 1.5
        tol = _tolerance(hf, p + c.token_ids)
        for row, tok, lp in zip(rows, c.token_ids, c.logprobs):
            floor = row.max() + torch.log(torch.tensor(0.2))
            assert row[tok] >= floor - tol
            if bool(((row - floor).abs() <= tol).any()):
                continue  # a token on the floor within rounding: the kept set is not defined by fp32
            processed = torch.log_softmax(row.masked_fill(row < floor, float("-inf")), -1)
            assert lp == pytest.approx(float(processed[tok]), abs=2 * tol)


def test_top_logprobs_match_hf(llm, hf_models):
    hf = hf_models["qwen2"]
    p = random_prompts(1, 15, 15, 2000, seed=33)[0]
    c = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, logprobs=4), use_tqdm=False)[0].outputs[0]
    assert len(c.top_logprobs) == len(c.token_ids)
    rows = _hf_rows(hf, p + c.token_ids)[len(p) - 1 : -1]
    tol = _tolerance(hf, p + c.token_ids)
    for row, tok, lp, top in zip(rows, c.token_ids, c.logprobs, c.top_logprobs):
        assert len(top) == 4 and top[tok].logprob == lp and top[tok].rank == 1  # greedy: the top entry
        for t, entry in top.items():
            assert entry.logprob == pytest.approx(float(row[t]), abs=tol)
            assert entry.decoded_token == llm.tokenizer.decode([t])
            _assert_rank(row, entry, tol)
        assert sorted(e.rank for e in top.values()) == [1, 2, 3, 4]
        assert sorted(top) == sorted(row.topk(4).indices.tolist())


def _assert_rank(row: torch.Tensor, entry, tol: float) -> None:
    """The rank the engine gave a token is 1 + the tokens HF finds more likely, up to the tokens
    within fp32's tolerance of it (rounding may order those either way)."""
    surely_above = int((row > entry.logprob + 2 * tol).sum())
    maybe_above = int((row > entry.logprob - 2 * tol).sum())
    assert surely_above + 1 <= entry.rank <= maybe_above + 1


def test_prompt_logprobs_match_hf_even_for_a_cached_prompt(llm, hf_models):
    hf = hf_models["qwen2"]
    p = random_prompts(1, 20, 20, 2000, seed=34)[0]
    llm.generate([p], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # now in the prefix cache
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, n=2), use_tqdm=False)[0]
    rows = _hf_rows(hf, p)
    tol = _tolerance(hf, p)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    ranks = []
    for j, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert p[j] in entry and len(entry) <= 3
        for t, e in entry.items():
            assert e.logprob == pytest.approx(float(rows[j - 1, t]), abs=tol)
            _assert_rank(rows[j - 1], e, tol)
        assert set(rows[j - 1].topk(2).indices.tolist()) <= set(entry)
        ranks.append(entry[p[j]].rank)
    assert max(ranks) > 2, "every prompt token was in the top 2: the ranks past k went untested"
    plain = llm.generate([p], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and all(c.top_logprobs is None for c in plain.outputs)


def test_prompt_logprobs_are_the_same_whatever_the_chunk(llm, monkeypatch):
    """Long prompts are turned into logprobs a chunk of positions at a time (bounded memory):
    each position's entry is computed from its own row alone, so chunks change nothing."""
    import engine.prompt_logprobs

    p = random_prompts(1, 40, 40, 2000, seed=35)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    whole = llm.generate([p], params, use_tqdm=False)[0].prompt_logprobs
    monkeypatch.setattr(engine.prompt_logprobs, "PROMPT_LOGPROBS_CHUNK", 7)
    chunked = llm.generate([p], params, use_tqdm=False)[0].prompt_logprobs
    assert len(chunked) == len(p) and chunked == whole
