"""Decode attention runs on length-sorted chunks of the batch: the cut, and exactness with many chunks."""

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.model_runner import decode_chunks
from tests.engine.helpers import hf_greedy, random_prompts


def test_one_chunk_per_block_count():
    assert decode_chunks([1, 1, 2, 3, 3, 3], min_rows=1) == [(0, 2, 1), (2, 3, 2), (3, 6, 3)]


def test_small_chunks_merge_into_the_longer_next():
    assert decode_chunks([1, 2, 2, 3, 3, 3, 4], min_rows=3) == [(0, 3, 2), (3, 6, 3), (6, 7, 4)]
    assert decode_chunks([5], min_rows=16) == [(0, 1, 5)]
    assert decode_chunks([1, 2, 3], min_rows=16) == [(0, 3, 3)]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_exact_with_many_chunks(arch, model_dirs, hf_models):
    llm = LLM(EngineConfig(model=model_dirs[arch], max_num_seqs=16, max_model_len=256, block_size=4))
    llm.core.runner.decode_chunk_min_rows = 1  # every block count its own chunk
    prompts = random_prompts(10, 2, 60, 2000, seed=11)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 20, ignore_eos=True)
