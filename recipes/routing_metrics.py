"""What a user watches when episodes run over several sidecars (issue 66 item 3), as a step's metrics:
each sidecar's prefix-cache hit rate and generated tokens over the step (their `load` and `stats`
replies), the spread of those tokens (max over mean: 1.0 is even), and the placement's sessions and
moves (the client's, or the router's /health)."""

from __future__ import annotations


def sidecar_counters(client) -> list[dict]:
    """Per sidecar the client uses: prefix-cache hit and query tokens and generated tokens since its start."""
    loads, stats = client.load(), client.stats()
    loads, stats = (loads, stats) if isinstance(loads, list) else ([loads], [stats])
    return [{"hit": ld["prefix_hit_tokens"], "query": ld["prefix_query_tokens"], "tokens": st["generated_tokens"]}
            for ld, st in zip(loads, stats)]


def step_metrics(now: list[dict], before: list[dict] | None, placement: dict | None) -> dict:
    """routing/*: per sidecar k, `prefix_hit_rate/k` and `tokens/k` over the step; `tokens_max_over_mean`;
    `sessions` and `moves` since the run began (`placement`: AsyncRolloutClient.placement_stats() or a
    router's /health). Nothing for one sidecar."""
    if len(now) < 2:
        return {}
    if before is None or len(before) != len(now):  # the first step, or a sidecar went or came: from zero
        before = [{"hit": 0, "query": 0, "tokens": 0}] * len(now)
    out = {}
    tokens = []
    for k, (n, b) in enumerate(zip(now, before)):
        query = n["query"] - b["query"]
        out[f"routing/prefix_hit_rate/{k}"] = (n["hit"] - b["hit"]) / query if query else 0.0
        tokens.append(n["tokens"] - b["tokens"])
        out[f"routing/tokens/{k}"] = tokens[-1]
    mean = sum(tokens) / len(tokens)
    out["routing/tokens_max_over_mean"] = max(tokens) / mean if mean else 1.0
    if placement:
        out["routing/sessions"], out["routing/moves"] = placement["sessions"], placement["moves"]
    return out
