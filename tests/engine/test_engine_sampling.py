"""Sampling through the whole engine: seeds, n, stop conditions."""

import pytest

from engine import LLM, EngineConfig, SamplingParams
from tests.engine.helpers import random_prompts


@pytest.fixture(scope="module")
def llm(qwen2_dir):
    return LLM(EngineConfig(model=qwen2_dir, max_num_seqs=32, max_model_len=256))


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_same_seed_same_output_whatever_shares_the_batch(llm):
    p = random_prompts(1, 20, 20, 2000, seed=20)[0]
    seeded = SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=123)
    alone = llm.generate([p], seeded, use_tqdm=False)
    others = random_prompts(5, 5, 40, 2000, seed=21)
    crowd = llm.generate(others[:2] + [p] + others[2:], [SamplingParams(temperature=1.0, max_tokens=25)] * 2
                         + [seeded] + [SamplingParams(temperature=0.8, top_k=10, max_tokens=15)] * 3,
                         use_tqdm=False)
    assert _tokens(alone)[0] == _tokens(crowd)[2]
    a, b = _tokens(alone)[0]
    assert a != b  # the n samples of one seeded request differ from each other


def test_unseeded_samples_differ(llm):
    p = random_prompts(1, 20, 20, 2000, seed=22)[0]
    outs = llm.generate([p], SamplingParams(n=8, temperature=1.0, max_tokens=16), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    assert [c.index for c in outs[0].outputs] == list(range(8))


def test_max_tokens_and_length_finish(llm):
    prompts = random_prompts(4, 5, 10, 2000, seed=23)
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, seed=m) for m in (1, 5, 17, 40)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 5, 17, 40]
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)


def test_max_model_len_caps_generation(qwen2_dir):
    llm = LLM(EngineConfig(model=qwen2_dir, max_model_len=32))
    p = random_prompts(1, 20, 20, 2000, seed=24)[0]
    c = llm.generate([p], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(c[0].outputs[0].token_ids) == 12 and c[0].outputs[0].finish_reason == "length"


def test_stop_token_ids(llm):
    p = random_prompts(1, 10, 10, 2000, seed=25)[0]
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    toks = free[0].outputs[0].token_ids
    stop_at = toks[7]
    c = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at]),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids == toks[: toks.index(stop_at) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at


def test_eos_and_ignore_eos(eos_model_dir):
    """An EOS id from generation_config.json is emitted and stops; with ignore_eos it does not."""
    import json
    from pathlib import Path

    eos = json.loads((Path(eos_model_dir) / "generation_config.json").read_text())["eos_token_id"]
    llm = LLM(EngineConfig(model=eos_model_dir, max_model_len=256))
    # the prompt whose greedy continuation holds the extra EOS id (see the fixture): greedy, then
    # sampled cool; and other prompts sampled
    prompts = random_prompts(1, 10, 10, 2000, seed=99) * 8 + random_prompts(8, 5, 30, 2000, seed=26)
    params = [SamplingParams(temperature=0.3 if i else 0.0, max_tokens=40, seed=i) for i in range(16)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped, "no sample hit EOS; pick another seed"
    assert all(c.token_ids[-1] in eos and not set(c.token_ids[:-1]) & set(eos) for c in stopped)
    assert all(c.stop_reason is None for c in stopped)
    for p in params:
        p.ignore_eos = True
    ignored = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in ignored)


def test_stop_strings(llm):
    p = llm.tokenizer("Q: what is one plus two? A:")["input_ids"]
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[10:13]
    assert len(stop) == 3 and text.find(stop) == 10
    c = llm.generate([p], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00zz"]),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:10]
    assert len(c.token_ids) < 40 and free[0].outputs[0].token_ids[: len(c.token_ids)] == c.token_ids
    kept = llm.generate([p], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                                            include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:13]


def test_string_and_dict_prompts(llm):
    p = "Q: what is two plus two? A:"
    ids = llm.tokenizer(p, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=8)
    a, b, c = llm.generate([p, ids, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert a.prompt == p and a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    single = llm.generate(ids, params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == a.outputs[0].token_ids


def test_generate_hides_the_heap_from_the_collector_only_while_it_runs(llm):
    """generate freezes what existed before it (as vLLM's engine core freezes its start-up heap) and gives
    it back after; a heap the process froze itself stays frozen (its count may drop: frozen objects still
    die by their references)."""
    import gc

    frozen_during = []
    step = llm.core.step
    llm.core.step = lambda: (frozen_during.append(gc.get_freeze_count()), step())[1]
    try:
        assert gc.get_freeze_count() == 0
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert frozen_during and min(frozen_during) > 0
        assert gc.get_freeze_count() == 0
        gc.freeze()
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        del llm.core.step
