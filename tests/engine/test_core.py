"""EngineCore driven step by step: continuous batching, abort at any time."""

import pytest

from engine import EngineConfig, SamplingParams
from engine.core import EngineCore
from tests.engine.helpers import random_prompts


def test_requests_join_and_leave_the_running_batch(qwen2_dir):
    core = EngineCore(EngineConfig(model=qwen2_dir, max_num_seqs=4, max_model_len=128))
    prompts = random_prompts(6, 4, 12, 2000, seed=40)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True))
    batch_sizes, finished = [], []
    while core.has_unfinished():
        assert len(core.scheduler.running) <= 4
        deltas = core.step()
        batch_sizes.append(len(deltas))
        finished += [d.request_id for d in deltas if d.finish_reason]
    assert finished == [f"r{i}" for i in range(6)]  # shorter budgets leave first
    assert 4 in batch_sizes and max(batch_sizes) == 4  # max_num_seqs is respected and reached
    assert core.block_manager.num_free_blocks == core.runner.num_blocks


def test_abort_waiting_and_running(qwen2_dir):
    core = EngineCore(EngineConfig(model=qwen2_dir, max_num_seqs=2, max_model_len=128))
    for i, p in enumerate(random_prompts(4, 4, 12, 2000, seed=41)):
        core.add_request(f"r{i}", p, SamplingParams(n=1 if i else 2, max_tokens=50, ignore_eos=True))
    core.step()
    core.step()
    assert {s.request_id for s in core.scheduler.running} == {"r0"}
    deltas = core.abort_requests(["r0", "r3", "missing"])
    assert sorted((d.request_id, d.index, d.finish_reason) for d in deltas) == [
        ("r0", 0, "abort"), ("r0", 1, "abort"), ("r3", 0, "abort")]
    done = set()
    while core.has_unfinished():
        done |= {d.request_id for d in core.step() if d.finish_reason}
    assert done == {"r1", "r2"}
    assert core.block_manager.num_free_blocks == core.runner.num_blocks


def test_kv_cache_size_from_a_memory_budget():
    from engine.kv_cache_size import kv_cache_blocks

    assert kv_cache_blocks(100 * 10, 10, want=64, min_blocks=8) == 64  # room for every sequence
    assert kv_cache_blocks(20 * 10 + 9, 10, want=64, min_blocks=8) == 20  # what the budget holds
    for budget in (7 * 10, -5):  # less than one full-length sequence (or a GPU already full)
        with pytest.raises(ValueError, match="fewer than one sequence"):
            kv_cache_blocks(budget, 10, want=64, min_blocks=8)


def test_a_window_on_every_layer_sizes_the_cache_for_its_windows():
    from engine.kv_cache_size import blocks_wanted

    assert blocks_wanted(8, 128, 8, 256) == 8 * 16  # every sequence at full length
    # a window of 16 keys spans 2 blocks of 8, 3 where it starts mid-block; one prefill step of 256 tokens
    assert blocks_wanted(8, 128, 8, 256, window=16) == 8 * 3 + 32
    assert blocks_wanted(8, 128, 8, 256, window=17) == 8 * 4 + 32
    assert blocks_wanted(2, 128, 8, 256, window=16) == 2 * 16  # never more than the full lengths
    assert blocks_wanted(8, 128, 8, 256, window=None) == blocks_wanted(8, 128, 8, 256, window=0) == 128


def test_gpu_memory_utilization_is_checked(qwen2_dir):
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(model=qwen2_dir, gpu_memory_utilization=bad)
