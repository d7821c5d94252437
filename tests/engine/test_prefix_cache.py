"""Prefix caching: hits are counted, and outputs do not change with caching on or off."""

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams as SP
from engine.sequence import Sequence
from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance, random_prompts


def _run(model, caching, prompts, params):
    llm = LLM(EngineConfig(model=model, max_num_seqs=32, max_model_len=256, block_size=8,
                           enable_prefix_caching=caching))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def test_outputs_equal_with_caching_on_or_off(qwen2_dir, hf_models):
    prefix = random_prompts(1, 33, 33, 2000, seed=30)[0]
    prompts = [prefix + t for t in random_prompts(3, 2, 20, 2000, seed=31)] + [prefix, prefix]
    for params in (SamplingParams(n=4, temperature=0, max_tokens=20), SamplingParams(n=4, max_tokens=20, seed=9)):
        on, a = _run(qwen2_dir, True, prompts, params)
        off, b = _run(qwen2_dir, False, prompts, params)
        assert on.core.block_manager.prefix_hits > 0 and off.core.block_manager.prefix_hits == 0
        for ra, rb in zip(a, b):
            for (ta, la), (tb, lb) in zip(ra, rb):
                assert ta == tb
                # a cache hit attends through another path (gathered blocks, offset mask): the
                # same arithmetic in another order
                hf = hf_models["qwen2"]
                tol = fp32_logprob_tolerance(hf.config, activation_magnitude(hf, prompts[0] + ta))
                assert la == pytest.approx(lb, abs=tol)


def test_group_samples_share_the_prompt_blocks(qwen2_dir):
    llm = LLM(EngineConfig(model=qwen2_dir, max_model_len=256, block_size=8))
    prompt = random_prompts(1, 41, 41, 2000, seed=32)[0]  # 5 full blocks + 1 token
    out = llm.generate([prompt], SamplingParams(n=8, max_tokens=4, seed=0), use_tqdm=False)[0]
    # the 7 siblings of the first sample each reuse its 5 full blocks
    assert llm.core.block_manager.prefix_hits == 7 * 40
    assert out.num_cached_tokens == 40
    again = llm.generate([prompt], SamplingParams(max_tokens=4, seed=0), use_tqdm=False)[0]
    assert again.num_cached_tokens == 40  # a repeated prompt hits freed-but-cached blocks
    assert llm.core.stats()["prefix_cache_hit_tokens"] == 8 * 40


def test_reset_prefix_cache_forgets(qwen2_dir):
    llm = LLM(EngineConfig(model=qwen2_dir, max_model_len=256, block_size=8))
    prompt = random_prompts(1, 30, 30, 2000, seed=33)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.core.reset_prefix_cache()
    assert llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0].num_cached_tokens == 0


def _seq(tokens, bs=4):
    return Sequence("r", 0, tokens, SP(max_tokens=4), bs)


def test_block_manager_ref_counts_and_lru():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = _seq(list(range(10))), _seq(list(range(10)))
    bm.allocate(a, bm.cached_prefix_blocks(a))
    hits = bm.cached_prefix_blocks(b)
    assert hits == a.block_table[:2]  # two full blocks shared, the partial third is not
    bm.allocate(b, hits)
    assert b.num_computed_tokens == 8 and bm.num_free_blocks == 2
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 6
    c = _seq(list(range(10)))
    assert bm.cached_prefix_blocks(c) == hits  # freed blocks still serve hits until reused
    # a prompt that is exactly two blocks long must recompute its last block (>= 1 token to run)
    d = _seq(list(range(8)))
    assert bm.cached_prefix_blocks(d) == hits[:1]


def test_block_hash_is_chained():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a, [])
    b = _seq([9, 9, 9, 9, 5, 6, 7, 8, 9])  # same second block, different first
    assert bm.cached_prefix_blocks(b) == []
