"""The sidecars' prefix caches as a step's metrics: each engine reports its counters since start in
its health (engine/core.py prefix_cache_stats); a step logs what changed since the last step."""

from __future__ import annotations

KINDS = ("hit_tokens", "query_tokens", "hit_tokens_other_version", "blocks_dropped")


def totals(health) -> dict[str, int] | None:
    """The counters summed over every engine of every sidecar in `health` (a client's health(): one
    reply or a list); None when no engine reports them (vLLM's)."""
    replies = health if isinstance(health, list) else [health]
    states = [s.get("prefix_cache") for r in replies for s in r.get("engine_states", [])]
    states = [s for s in states if s]
    if not states:
        return None
    return {k: sum(s.get(k, 0) for s in states) for k in KINDS}


def step_metrics(now: dict[str, int] | None, before: dict[str, int] | None) -> dict:
    """prefix_cache/*: the share of the step's prompt tokens served from cache, the tokens served from
    another weight version's blocks (0 unless a request asked: SamplingParams.prefix_version) and the
    cached blocks forgotten (a push keeps them: 0 on our engine) between two totals."""
    if now is None:
        return {}
    d = {k: now[k] - (before or {}).get(k, 0) for k in KINDS}
    return {"prefix_cache/hit_rate": d["hit_tokens"] / d["query_tokens"] if d["query_tokens"] else 0.0,
            "prefix_cache/hit_tokens": d["hit_tokens"],
            "prefix_cache/hit_tokens_other_version": d["hit_tokens_other_version"],
            "prefix_cache/blocks_dropped": d["blocks_dropped"]}
