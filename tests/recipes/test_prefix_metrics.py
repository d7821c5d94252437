"""recipes/prefix_metrics.py: the sidecars' prefix-cache counters as a step's, by hand."""

from recipes import prefix_metrics as PM


def _reply(*states):
    return {"engine_states": [{"state": "live", "prefix_cache": s} for s in states]}


def test_totals_sum_every_engine_of_every_sidecar_and_none_when_nothing_reports():
    a = {"hit_tokens": 10, "query_tokens": 40, "hit_tokens_other_version": 0, "blocks_dropped": 1}
    b = {"hit_tokens": 5, "query_tokens": 10, "hit_tokens_other_version": 2, "blocks_dropped": 0}
    assert PM.totals([_reply(a), _reply(b)]) == {"hit_tokens": 15, "query_tokens": 50,
                                                 "hit_tokens_other_version": 2, "blocks_dropped": 1}
    assert PM.totals(_reply(a)) == a
    assert PM.totals({"engine_states": [{"state": "live"}]}) is None  # vLLM's engines report none


def test_a_steps_metrics_are_the_change_since_the_last_step():
    before = {"hit_tokens": 15, "query_tokens": 50, "hit_tokens_other_version": 2, "blocks_dropped": 1}
    now = {"hit_tokens": 45, "query_tokens": 90, "hit_tokens_other_version": 2, "blocks_dropped": 1}
    assert PM.step_metrics(now, before) == {"prefix_cache/hit_rate": 30 / 40, "prefix_cache/hit_tokens": 30,
                                            "prefix_cache/hit_tokens_other_version": 0,
                                            "prefix_cache/blocks_dropped": 0}
    assert PM.step_metrics(now, None)["prefix_cache/hit_rate"] == 45 / 90
    assert PM.step_metrics(None, before) == {}
    assert PM.step_metrics(before, before)["prefix_cache/hit_rate"] == 0.0
