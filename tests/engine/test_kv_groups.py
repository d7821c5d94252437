"""A model mixing windowed and full-attention layers (Gemma 3's, Qwen2's under use_sliding_window) keeps a
KV cache per kind (engine/kv_groups.py, engine/grouped_blocks.py): the grouping, each group's size, the
two block managers' bookkeeping behind the scheduler's one interface, then tiny Gemma 3 engines giving
HF's greedy tokens in fp32 past the window in a cache a fraction of one cache's bytes, without a
preemption, and through preemptions where the cache is set too small. (Greedy == HF for every windowed
family on every attention path, now on two groups where they mix: tests/engine/test_sliding_window.py,
test_gemma_model.py; the exact scorer on them: test_exact_logprobs.py.)"""

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.block_manager import BlockManager
from engine.grouped_blocks import GroupedBlocks
from engine.kv_cache_size import group_blocks
from engine.kv_groups import KVGroups, of_windows
from engine.sampling_params import SamplingParams as SP
from engine.sequence import Sequence
from tests.engine.helpers import hf_greedy, random_prompts


def test_layers_mixing_windows_get_two_groups_and_alike_layers_one():
    assert of_windows([None, None]) == KVGroups((None,), (0, 0))
    assert of_windows([16, 8, 16]) == KVGroups((16,), (0, 0, 0))  # every layer windowed: the largest serves
    assert of_windows([32, 32, 32, None]) == KVGroups((None, 32), (1, 1, 1, 0))
    assert of_windows([32, None, 16]).layers(1) == [0, 2] and of_windows([32, None, 16]).windows == (None, 32)
    assert of_windows([32, 32, 32, None], hybrid=False) == KVGroups((None,), (0, 0, 0, 0))


def _cfg(num_kv_blocks=None) -> SimpleNamespace:
    """The EngineConfig fields group_blocks reads."""
    return SimpleNamespace(max_num_seqs=8, max_model_len=128, block_size=8, max_num_batched_tokens=256,
                           num_kv_blocks=num_kv_blocks)


def test_each_group_gets_what_it_wants_and_a_short_budget_as_many_full_length_sequences_as_fit():
    # the full group: 8 sequences x 16 blocks; the windowed one (16 keys): 8 x 3 + a prefill step's 32
    fits = group_blocks(_cfg(), [10, 30], [None, 16], lambda least: 10**9)
    assert fits == [128, 56]
    # s sequences at full length take 16s blocks of 10 bytes and min(16s, 3s + 16) of 30 (their windows and
    # one prompt of 16 blocks): 7 take 2230 bytes, 8 take 2480; what a budget of 2470 holds past 7's goes
    # to each group in proportion to what it still wants (16 and 19 blocks: 240 / 730 of them)
    assert group_blocks(_cfg(), [10, 30], [None, 16], lambda one: 2470) == [112 + 5, 37 + 6]
    assert group_blocks(_cfg(), [10, 30], [None, 16], lambda one: 16 * 10 + 16 * 30) == [16, 16]  # one sequence
    with pytest.raises(ValueError, match="each group of layers"):
        group_blocks(_cfg(), [10, 30], [None, 16], lambda one: 16 * 10 + 16 * 30 - 1)
    # num_kv_blocks sets the full group's; the windowed group's is no more than it wants
    assert group_blocks(_cfg(num_kv_blocks=100), [10, 30], [None, 16], None) == [100, 56]
    assert group_blocks(_cfg(num_kv_blocks=40), [10, 30], [None, 16], None) == [40, 40]


def _managers(full: int, windowed: int) -> GroupedBlocks:
    return GroupedBlocks([BlockManager(full, 4), BlockManager(windowed, 4, window=6, spare=windowed, group=1)])


def test_the_windowed_group_hands_back_what_the_full_one_keeps():
    bm = _managers(full=20, windowed=6)
    a = Sequence("r", 0, list(range(100, 105)), SP(max_tokens=40), 4)
    assert bm.can_allocate(a, bm.cached_prefix_blocks(a))
    bm.allocate(a, bm.cached_prefix_blocks(a))
    for t in range(30):  # the scheduler's decode bookkeeping
        a.token_ids.append(t)
        bm.release_behind_window(a)
        assert bm.can_append(a)
        bm.append_slot(a)
        a.num_computed_tokens = len(a) - 1
    n = len(a)  # 35 tokens: 9 blocks in each table
    assert len(a.tables[0]) == len(a.tables[1]) == 9
    assert 20 not in a.tables[0] and bm.managers[0].num_free_blocks == 20 - 9
    assert a.released == [0, (n - 6) // 4] and a.tables[1][:7] == [6] * 7  # the windowed group's spare
    assert bm.managers[1].num_free_blocks == 6 - 2
    # a prefix hit: the full group's 8 whole blocks, the windowed group's last window of them (keys 27-31,
    # read by the first token computed, 32: blocks 6, 7) and its spare before (blocks 0-5 handed out again)
    b = Sequence("r", 1, a.token_ids[:33], SP(max_tokens=1), 4)
    hits = bm.cached_prefix_blocks(b)
    assert hits[0] == a.tables[0][:8] and hits[1][:6] == [6] * 6 and hits[1][7] == a.tables[1][7]
    assert hits[1][6] in bm.managers[1].free and bm.cached_tokens(hits) == 32  # gone back, still cached
    bm.allocate(b, hits)
    assert b.released == [0, 6] and b.tables[1][:8] == hits[1] and b.num_computed_tokens == 32
    bm.free_seq(b)
    # admission needs room in every group: 12 tokens more than the windowed group's free blocks hold
    c = Sequence("r", 2, list(range(500, 520)), SP(max_tokens=1), 4)
    assert bm.managers[0].can_allocate(c, []) and not bm.managers[1].can_allocate(c, [])
    assert not bm.can_allocate(c, bm.cached_prefix_blocks(c))
    bm.free_seq(a)
    assert [m.num_free_blocks for m in bm.managers] == [20, 6] and a.tables == [[], []] and a.released == [0, 0]


@pytest.fixture(scope="module")
def gemma_dir(tiny_dirs):
    return tiny_dirs["gemma3"]  # a window of 32 keys on three layers of four


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def _greedy(llm, prompts, max_tokens):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_default_cache_a_fraction_of_one_caches_bytes_gives_hfs_tokens(gemma_dir, hf_gemma):
    """8 sequences of up to 192 tokens in blocks of 8: one cache of every layer holds 8 x 24 blocks of 4
    layers; two hold the full layer's 8 x 24 and the windowed layers' 8 x (4 + 1) + one prefill step's
    (256 tokens: 32 blocks) and a spare, of 3 layers. Decoded 150 tokens past prompts of 20-40 (windows of
    32 crossed many times): HF's greedy tokens, no preemption."""
    prompts = random_prompts(8, 20, 40, 2000, seed=41)
    kw = dict(model=gemma_dir, max_num_seqs=8, max_model_len=192, block_size=8, max_num_batched_tokens=256)
    one = LLM(EngineConfig(**kw, disable_hybrid_kv_cache_manager=True))
    llm = LLM(EngineConfig(**kw))
    runner = llm.core.runner
    assert runner.kv_groups.windows == (None, 32) and runner.group_blocks == [8 * 24, 8 * 5 + 32]
    per_layer_block = 2 * 8 * runner.num_kv_heads * runner.head_dim * 4  # keys and values, fp32
    assert llm.core.worker.memory()["kv_cache"] == per_layer_block * (1 * 8 * 24 + 3 * (8 * 5 + 32 + 1))
    assert one.core.worker.memory()["kv_cache"] == per_layer_block * 4 * 8 * 24
    del one
    got = _greedy(llm, prompts, 150)
    assert llm.core.scheduler.num_preemptions == 0
    assert got == [hf_greedy(hf_gemma, p, 150, ignore_eos=True) for p in prompts]
    stats = llm.core.stats()
    assert stats["num_free_blocks_per_group"] == stats["num_blocks_per_group"] == runner.group_blocks  # all back


def test_a_cache_set_too_small_preempts_and_still_gives_hfs_tokens(gemma_dir, hf_gemma):
    """num_kv_blocks=40 (the full group's; the windowed one's the same): 8 sequences growing to 24 blocks
    each outgrow it, and are preempted and computed again in both groups."""
    # (seed 43's first prompt draws EOS, which HF's min_new_tokens masks and our ignore_eos does not)
    prompts = random_prompts(8, 20, 40, 2000, seed=47)
    llm = LLM(EngineConfig(model=gemma_dir, max_num_seqs=8, max_model_len=192, block_size=8, num_kv_blocks=40,
                           max_num_batched_tokens=256))
    assert llm.core.runner.group_blocks == [40, 40]
    got = _greedy(llm, prompts, 120)
    assert llm.core.scheduler.num_preemptions > 0
    assert got == [hf_greedy(hf_gemma, p, 120, ignore_eos=True) for p in prompts]
