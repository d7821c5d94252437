"""The KV cache's share of a GPU (engine/gpu_memory.py): of the device's total, less the engine's
measured peak and a push's staging reserve; refused by name when it cannot be had."""

import pytest

from engine.gpu_memory import GiB, kv_budget_bytes


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
