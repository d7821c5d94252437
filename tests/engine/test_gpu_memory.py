"""The KV cache's share of a GPU (engine/gpu_memory.py): of the device's total, less the engine's
measured peak and a push's staging reserve; refused by name when it cannot be had; decode rows
bounded by what the cache serves."""

import pytest

from engine.gpu_memory import GiB, kv_budget_bytes, rows_beside_cache


def test_the_share_is_of_the_total_not_of_what_others_left():
    # an 80 GiB GPU, a colocated trainer holds 30 GiB; this engine asks for 0.5 and holds 2 GiB
    budget = kv_budget_bytes(80 * GiB, free=48 * GiB, utilization=0.5, held=2 * GiB, peak=6 * GiB, reserve=2 * GiB)
    assert budget == 40 * GiB - 6 * GiB - 2 * GiB


def test_a_share_that_is_not_free_is_refused_with_the_figure_that_fits():
    with pytest.raises(ValueError, match=r"only 10\.00 GiB are free.*other processes hold 68\.00 GiB.*at most 0\.15"):
        kv_budget_bytes(80 * GiB, free=10 * GiB, utilization=0.9, held=2 * GiB, peak=4 * GiB, reserve=0)


def test_nothing_left_for_the_cache_is_refused():
    with pytest.raises(ValueError, match="nothing is left for the KV cache"):
        kv_budget_bytes(16 * GiB, free=15 * GiB, utilization=0.5, held=1 * GiB, peak=7 * GiB, reserve=1 * GiB)


def test_the_staging_reserve_comes_out_of_the_cache():
    a = kv_budget_bytes(80 * GiB, 79 * GiB, 0.9, 1 * GiB, 5 * GiB, reserve=0)
    b = kv_budget_bytes(80 * GiB, 79 * GiB, 0.9, 1 * GiB, 5 * GiB, reserve=3 * GiB)
    assert a - b == 3 * GiB


def test_rows_that_fit_beside_the_cache_keep_max_num_seqs():
    rows, cache = rows_beside_cache(10 * GiB, per_block=1 << 20, per_row=4 << 20, max_num_seqs=256)
    assert (rows, cache) == (256, 10 * GiB - 256 * (4 << 20))


def test_rows_past_what_the_cache_serves_are_as_many_as_its_blocks():
    # a max_num_seqs of a million: the rows' memory alone would pass the budget
    per_block, per_row, budget = 64 << 10, 300 << 10, 28 * GiB
    rows, cache = rows_beside_cache(budget, per_block, per_row, max_num_seqs=10**6)
    assert rows == budget // (per_block + per_row)
    assert cache // per_block >= rows  # every row can hold a block
    assert rows * per_row + cache == budget
    # one more row would leave fewer blocks than rows
    assert (budget - (rows + 1) * per_row) // per_block < rows + 1


def test_a_budget_of_less_than_one_row_still_gives_one():
    assert rows_beside_cache(1000, per_block=600, per_row=600, max_num_seqs=8)[0] == 1


def test_max_num_seqs_past_the_caches_blocks_is_lowered_to_them(model_dirs):
    from engine import LLM, EngineConfig, SamplingParams

    llm = LLM(EngineConfig(model=model_dirs["qwen2"], max_num_seqs=10**6, max_model_len=64, num_kv_blocks=12))
    assert llm.core.runner.max_num_seqs == llm.core.scheduler.max_num_seqs == 12
    outs = llm.generate([[5, 6, 7]] * 20, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] * 20


def test_an_engine_that_fails_to_start_lets_go_of_its_weights(model_dirs):
    from engine import EngineConfig
    from engine.model_runner import ModelRunner

    # a cache too small for one sequence: refused after the weights are loaded
    cfg = EngineConfig(model=model_dirs["qwen2"], max_model_len=1024, num_kv_blocks=2)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len") as failed:
        ModelRunner(cfg)
    runner = next(e.frame.f_locals["self"] for e in failed.traceback
                  if isinstance(e.frame.f_locals.get("self"), ModelRunner))
    assert runner.model is None and runner.k_cache is None
