"""vLLM's sampling parameters RL code uses, through the whole engine: greedy output against HF
`generate` with the matching logits processor (min_tokens, bad_words, logit_bias,
allowed_token_ids), min_tokens with stop strings, max_logprobs, ids outside the vocabulary,
and logprobs=0."""

import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, Logprob, SamplingParams
from tests.engine.helpers import random_prompts


@pytest.fixture(scope="module")
def llm(qwen2_dir):
    return LLM(EngineConfig(model=qwen2_dir, max_num_seqs=8, max_model_len=128, block_size=8))


@pytest.fixture(scope="module")
def engine(qwen2_dir, loop):  # needs the loop: torn down after the engine
    eng = AsyncEngine(EngineConfig(model=qwen2_dir, max_model_len=64))
    yield eng
    eng.shutdown()


def _greedy(llm, prompt, **kw) -> list[int]:
    params = SamplingParams(temperature=0, **{"max_tokens": 16, "ignore_eos": True, **kw})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def _hf(model, prompt, max_new_tokens=16, **kw) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def test_min_tokens_holds_eos_back_as_hf(eos_model_dir, hf_models):
    """The EOS model's greedy output emits a second EOS id at its 9th token; min_tokens=12 masks
    it (and the first EOS id) until 12 tokens are out, as HF's min_new_tokens does."""
    llm = LLM(EngineConfig(model=eos_model_dir, max_model_len=128))
    prompt = random_prompts(1, 10, 10, 2000, seed=99)[0]
    params = SamplingParams(temperature=0, max_tokens=14)
    short = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) == 9
    params.min_tokens = 12
    held = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    eos = list(llm.core.eos_ids)
    assert held.token_ids == _hf(hf_models["qwen2"], prompt, 14, min_new_tokens=12, eos_token_id=eos)
    assert len(held.token_ids) >= 12 and not set(held.token_ids[:12]) & set(eos)


def test_min_tokens_ignores_a_stop_string_inside_the_first_tokens(llm):
    prompt = random_prompts(1, 12, 12, 2000, seed=40)[0]
    tokens = _greedy(llm, prompt, max_tokens=20)
    text = llm.tokenizer.decode(tokens)
    early = llm.tokenizer.decode(tokens[:3])
    stop = next(early[i:i + 3] for i in range(len(early) - 2) if text.count(early[i:i + 3]) == 1)
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) <= 3
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop,
                                                 min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert held.finish_reason == "length" and held.token_ids == tokens  # the only match lay in the first 3


def test_bad_words_as_hf_bad_words_ids(llm, hf_models):
    prompt = llm.tokenizer("the cat sat on the mat")["input_ids"]
    plain = _greedy(llm, prompt)
    # a word the output spells with one token, which vLLM's rule bans (its bare or its spaced form)
    token, word, banned = next((t, w, b) for t, w, b in (
        (t, w, SamplingParams(bad_words=[w]).bad_words_token_ids(llm.tokenizer))
        for t, w in ((t, llm.tokenizer.decode([t]).strip()) for t in plain) if w.isalpha()) if [t] in b)
    ours = _greedy(llm, prompt, bad_words=[word])
    assert ours == _hf(hf_models["qwen2"], prompt, bad_words_ids=banned, min_new_tokens=16)
    assert token not in ours and ours != plain


def test_logit_bias_as_hf_sequence_bias(llm, hf_models):
    prompt = random_prompts(1, 10, 10, 2000, seed=41)[0]
    plain = _greedy(llm, prompt)
    bias = {plain[1]: -3.0, 77: 2.0, 500: 4.0}
    ours = _greedy(llm, prompt, logit_bias=bias)
    theirs = _hf(hf_models["qwen2"], prompt, sequence_bias={(t,): b for t, b in bias.items()}, min_new_tokens=16)
    assert ours == theirs and ours != plain
    assert set(_greedy(llm, prompt, logit_bias={123: 100.0})) == {123}  # +100: the token always wins


def test_allowed_token_ids_as_hf_prefix_constraint(llm, hf_models):
    prompt = random_prompts(1, 10, 10, 2000, seed=42)[0]
    allowed = [5, 50, 500, 1000, 1500]
    ours = _greedy(llm, prompt, allowed_token_ids=allowed)
    theirs = _hf(hf_models["qwen2"], prompt, prefix_allowed_tokens_fn=lambda b, ids: allowed, min_new_tokens=16)
    assert ours == theirs and set(ours) <= set(allowed) and len(set(ours)) > 1
    sampled = llm.generate([prompt], SamplingParams(max_tokens=40, allowed_token_ids=allowed, seed=3), use_tqdm=False)
    assert set(sampled[0].outputs[0].token_ids) <= set(allowed)


def test_logprobs_zero_gives_the_sampled_token_with_its_rank(llm):
    prompt = random_prompts(1, 10, 10, 2000, seed=43)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, logprobs=0, seed=5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.top_logprobs) == 8
    for tok, lp, entry in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert list(entry) == [tok] and isinstance(entry[tok], Logprob)
        assert entry[tok].logprob == lp and entry[tok].rank >= 1
        assert entry[tok].decoded_token == llm.tokenizer.decode([tok])
    assert any(e[t].rank > 1 for t, e in zip(out.token_ids, out.top_logprobs)), "sampling at T=1 never left rank 1"
    raw = llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=1, detokenize=False), use_tqdm=False)
    assert all(e.decoded_token is None for pos in raw[0].outputs[0].top_logprobs for e in pos.values())


@pytest.mark.parametrize("bad, field", [
    (dict(stop_token_ids=[2048]), "stop_token_ids"),
    (dict(allowed_token_ids=[1, 5000]), "allowed_token_ids"),
    (dict(logit_bias={"9999": 1.0}), "logit_bias"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_out_of_range_requests_are_refused_and_the_engine_serves_on(llm, engine, loop, bad, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6, 7]], SamplingParams(**bad), use_tqdm=False)

    async def go():
        with pytest.raises(ValueError, match=field):
            async for _ in engine.generate([5, 6, 7], SamplingParams(**bad)):
                pass
        async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=3)):
            pass
        return out

    assert len(loop.run_until_complete(go()).outputs[0].token_ids) == 3
    assert len(_greedy(llm, [5, 6, 7], max_tokens=3)) == 3


def test_max_logprobs_is_the_engines_cap(qwen2_dir):
    llm = LLM(EngineConfig(model=qwen2_dir, max_model_len=64, max_logprobs=2))
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([[5, 6]], SamplingParams(logprobs=3), use_tqdm=False)
    out = llm.generate([[5, 6]], SamplingParams(logprobs=2, prompt_logprobs=2, max_tokens=2), use_tqdm=False)[0]
    assert all(len(e) in (2, 3) for e in out.outputs[0].top_logprobs)


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_seeds_outside_int64_are_refused(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("bad", [dict(min_tokens=-1), dict(min_tokens=5, max_tokens=4), dict(allowed_token_ids=[]),
                                 dict(bad_words=[""]), dict(bad_words="word"), dict(logit_bias={1: float("nan")}),
                                 dict(logit_bias={"x": 1.0}), dict(stop_token_ids=[-1])])
def test_bad_processor_fields_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
