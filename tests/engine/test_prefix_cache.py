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


def _seq_at(tokens, prefix_version=None, bs=4):
    return Sequence("r", 0, tokens, SP(max_tokens=4, prefix_version=prefix_version), bs)


def test_blocks_are_keyed_by_the_version_their_kv_was_computed_under():
    bm = BlockManager(num_blocks=16, block_size=4)
    version = [3]
    bm.current_version = lambda: version[0]
    a = _seq_at(list(range(10)))
    bm.allocate(a, bm.cached_prefix_blocks(a))
    assert bm.cached_prefix_blocks(_seq_at(list(range(10)))) == a.block_table[:2]  # same version: a hit
    version[0] = 4  # a push committed
    assert bm.cached_prefix_blocks(_seq_at(list(range(10)))) == []  # never another version's KV...
    kept = _seq_at(list(range(10)), prefix_version=3)
    assert bm.cached_prefix_blocks(kept) == a.block_table[:2]  # ...unless asked for by version
    bm.allocate(kept, bm.cached_prefix_blocks(kept))
    assert bm.prefix_hits_other_version == 8 and bm.prefix_blocks_dropped == 0
    # a sequence started under 3 keeps chaining its later blocks from 3's root after the push
    for t in (10, 11):
        a.token_ids.append(t)  # what a decode step appends
        bm.append_slot(a)
    assert bm.cached_prefix_blocks(_seq_at(list(range(12)) + [0], prefix_version=3)) == a.block_table[:3]
    assert bm.cached_prefix_blocks(_seq_at(list(range(12)) + [0])) == []
    # preempted after the push, it is computed again under 4: its lookup is 4's (it held 3's root before)
    bm.free_seq(a)
    assert a.prefix_root is None and bm.cached_prefix_blocks(a) == []


def test_a_push_keeps_the_cache_and_a_version_number_again_drops_it(qwen2_dir):
    """In the engine: after a version bump the same prompt hits nothing and no block was dropped;
    asked by version, it hits the old blocks (counted apart); setting a version number that is not
    newer drops the cache (its keys may now name other weights)."""
    llm = LLM(EngineConfig(model=qwen2_dir, max_model_len=256, block_size=8))
    prompt = random_prompts(1, 30, 30, 2000, seed=34)[0]  # 3 full blocks + 6 tokens
    params = SamplingParams(max_tokens=2)
    llm.generate([prompt], params, use_tqdm=False)
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 24
    llm.core.weight_version = 1
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0
    asked = SamplingParams(max_tokens=2, prefix_version=0)
    assert llm.generate([prompt], asked, use_tqdm=False)[0].num_cached_tokens == 24
    stats = llm.core.prefix_cache_stats()
    assert stats["hit_tokens_other_version"] == 24 and stats["blocks_dropped"] == 0
    assert stats["hit_tokens"] == 48 and stats["query_tokens"] == 4 * 30
    llm.core.weight_version = 1  # the same number again
    assert llm.core.prefix_cache_stats()["blocks_dropped"] > 0
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_bad_prefix_version_is_refused():
    for bad in (-1, "0", True, 1.5):
        with pytest.raises(ValueError, match="prefix_version must be None or an int >= 0"):
            SP(prefix_version=bad)
