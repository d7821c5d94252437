"""A model whose every layer has a sliding window hands a sequence's blocks behind the window back as it
decodes (engine/block_manager.py's release_behind_window): the bookkeeping on its own, then an engine
whose cache holds half of what its sequences would hold otherwise, giving HF's greedy tokens on every
attention path of our layers without a preemption, and a cache sized by default for the windows (not
the full lengths) doing the same."""

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.block_manager import BlockManager
from engine.kernels import native_kernels
from engine.sampling_params import SamplingParams as SP
from engine.sequence import Sequence
from tests.engine.helpers import hf_greedy, random_prompts


def _decode(bm: BlockManager, seq: Sequence, tokens: int, held: list[int]) -> None:
    """The scheduler's decode bookkeeping for `tokens` new tokens, each step's blocks held noted."""
    for t in range(tokens):
        seq.token_ids.append(t)
        bm.release_behind_window(seq)
        assert bm.can_append(seq)
        bm.append_slot(seq)
        seq.num_computed_tokens = len(seq) - 1
        held.append(sum(b != bm.spare for b in seq.block_table))


def test_blocks_wholly_behind_the_window_go_back_and_nothing_else():
    bm = BlockManager(num_blocks=12, block_size=4, window=6, spare=12)
    a = Sequence("r", 0, list(range(100, 105)), SP(max_tokens=40), 4)
    bm.allocate(a, bm.cached_prefix_blocks(a))
    held = []
    _decode(bm, a, 30, held)
    # the newest token's query sees keys len - 6 .. len - 1: block i (keys 4i .. 4i + 3) is kept
    # while 4i + 3 >= len - 6, so at most 3 blocks (a window of 6 spans 2-3 of them) and never fewer
    # than the window needs
    assert max(held) == 3 and min(held[5:]) >= 2
    n = len(a)  # 35: blocks 0..6 behind keys 29.. are released, 7 and 8 kept
    assert a.num_released_blocks == (n - 6) // 4 == 7
    assert a.block_table[:7] == [12] * 7 and 12 not in a.block_table[7:]
    assert bm.num_free_blocks == 12 - 2
    assert 12 not in bm.free  # the spare is never handed out
    # a released block keeps its hash: a new sequence on the same prefix hits it
    b = Sequence("r", 1, a.token_ids[:13], SP(max_tokens=1), 4)
    # (its first token, 12, reads keys 7-11: blocks 1 and 2; block 0 needs no hit, the spare stands in)
    hits = bm.cached_prefix_blocks(b)
    assert len(hits) == 3 and hits[0] == 12 and all(h in bm.free for h in hits[1:])
    bm.free_seq(a)
    assert bm.num_free_blocks == 12 and a.num_released_blocks == 0


def test_no_window_no_release_and_a_window_needs_its_spare():
    bm = BlockManager(num_blocks=12, block_size=4)
    a = Sequence("r", 0, list(range(5)), SP(max_tokens=40), 4)
    bm.allocate(a, [])
    held = []
    _decode(bm, a, 30, held)
    assert held[-1] == 9 and a.num_released_blocks == 0
    with pytest.raises(ValueError, match="spare"):
        BlockManager(num_blocks=12, block_size=4, window=6)


PATHS = {  # how our layers attend
    "c loop": {},
    "c kernel": {"ROLLOUT_NATIVE_LAYERS": "0"},
    "torch masks": {"ROLLOUT_NATIVE_KERNELS": "0"},
}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_cache_too_small_without_the_release_serves_hfs_tokens_without_a_preemption(path, variant_dirs,
                                                                                     variant_hf_models, monkeypatch):
    """Mistral's shape with a window of 16 on every layer, blocks of 8: four prompts of 20-44 tokens, two
    samples each sharing the prompt's blocks (a prefix hit), 56 new tokens: eight sequences of 10-13
    blocks would need about 80 and a cache of 40 would preempt; handing back the blocks behind the
    window (the shared ones once both samples are past them) each holds 3-4 and none is preempted."""
    for k, v in PATHS[path].items():
        monkeypatch.setenv(k, v)
    native_kernels.reset()
    try:
        llm = LLM(EngineConfig(model=variant_dirs["mistral_window"], max_num_seqs=8, max_model_len=128,
                               block_size=8, num_kv_blocks=40))
        assert type(llm.core.worker.model).__module__ == "engine.models.llama_model"
        assert llm.core.block_manager.window == 16
        hf = variant_hf_models["mistral_window"]
        prompts = random_prompts(4, 20, 44, 400, seed=23)
        greedy = SamplingParams(temperature=0, max_tokens=56, ignore_eos=True, n=2)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert [c.token_ids for c in o.outputs] == [hf_greedy(hf, p, 56, ignore_eos=True)] * 2
        assert llm.core.block_manager.prefix_hits > 0
        assert llm.core.scheduler.num_preemptions == 0
        assert llm.core.block_manager.num_free_blocks == 40
    finally:
        monkeypatch.undo()
        native_kernels.reset()


def test_the_default_cache_holds_the_windows_not_the_full_lengths(variant_dirs, variant_hf_models):
    """Left to size itself, the cache of eight sequences of up to 128 tokens under a window of 16 (blocks of
    8) gets 8 x 3 blocks and one prefill step's 128 tokens (16): 40 where the full lengths need 128, and
    serves eight prompts decoded to 124 tokens each with HF's tokens and no preemption."""
    llm = LLM(EngineConfig(model=variant_dirs["mistral_window"], max_num_seqs=8, max_model_len=128,
                           block_size=8, max_num_batched_tokens=128))
    assert llm.core.runner.num_blocks == 40
    hf = variant_hf_models["mistral_window"]
    prompts = random_prompts(8, 20, 44, 400, seed=31)  # 29's hit EOS, which HF's min_new_tokens masks
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=124 - len(p), ignore_eos=True)
                                  for p in prompts], use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 124 - len(p), ignore_eos=True)
    assert llm.core.scheduler.num_preemptions == 0
    assert llm.core.block_manager.num_free_blocks == 40
