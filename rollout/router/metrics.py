"""The router's GET /metrics (Prometheus' text format) and the same numbers as a dict for logs: per
sidecar, the calls answered, the sessions pinned there, its calls in flight, its state, and its own
load and prefix-cache counters as its last GET /load said; in all, sessions started, moves, failovers
and the prefix-cache hit share. (Sum the per-sidecar series for totals in PromQL.)"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout.router.sidecars import BEHIND, GONE, REMOVED, SERVING, STARTING

STATES = (SERVING, BEHIND, GONE, STARTING, REMOVED)


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("rollout_router_requests", "calls answered, by sidecar and status",
                                ["sidecar", "status"], registry=self.registry)
        self.failovers = Counter("rollout_router_failovers", "calls sent to another sidecar before any byte of "
                                 "their answer was relayed", registry=self.registry)
        self.unavailable = Counter("rollout_router_unavailable", "calls answered 503: no sidecar could take them",
                                   registry=self.registry)
        self.view = None  # (Sidecars, Placement): read at scrape time

    def watch(self, sidecars, placement) -> None:
        self.view = (sidecars, placement)
        self.registry.register(_Collector(self))

    def answered(self, url: str, status: int) -> None:
        self.requests.labels(url, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def snapshot(sidecars, placement) -> dict:
    """Per sidecar URL and in all: what /metrics says, as one dict (the recipes' logs, the bench)."""
    stats = placement.stats()
    per = {}
    for i, s in enumerate(sidecars.all):
        load = s.load
        per[s.url] = {"state": s.state, "sessions_pinned": stats["pinned_per_sidecar"].get(i, 0),
                      "in_flight": placement.busy[i], "groups": load.groups if load else 0,
                      "kv_used": load.kv_used if load else -1.0, "version": load.version if load else None,
                      "prefix_hit_tokens": load.prefix_hit_tokens if load else 0,
                      "prefix_query_tokens": load.prefix_query_tokens if load else 0}
    hits = sum(p["prefix_hit_tokens"] for p in per.values())
    queries = sum(p["prefix_query_tokens"] for p in per.values())
    return {"sidecars": per, "sessions": stats["sessions"], "pinned": stats["pinned"], "moves": stats["moves"],
            "serving": len(sidecars.serving()), "newest_version": sidecars.newest,
            "prefix_hit_share": hits / queries if queries else 0.0}


class _Collector:
    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def collect(self):
        sidecars, placement = self.metrics.view
        snap = snapshot(sidecars, placement)
        yield CounterMetricFamily("rollout_router_sessions", "sessions started", value=snap["sessions"])
        yield CounterMetricFamily("rollout_router_session_moves", "sessions moved off their sidecar (it went, "
                                  "paused too long, or was busier than the least busy by more than the margin)",
                                  value=snap["moves"])
        yield GaugeMetricFamily("rollout_router_prefix_hit_ratio", "prompt tokens served from the sidecars' prefix "
                                "caches over prompt tokens looked up, all sidecars", value=snap["prefix_hit_share"])
        gauges = {
            "sessions_pinned": GaugeMetricFamily("rollout_router_sessions_pinned", "sessions pinned to the sidecar",
                                                 labels=["sidecar"]),
            "in_flight": GaugeMetricFamily("rollout_router_in_flight", "the router's calls in flight on the sidecar",
                                           labels=["sidecar"]),
            "groups": GaugeMetricFamily("rollout_router_sidecar_prompts_in_flight", "prompts in flight on the "
                                        "sidecar, every client's, at its last /load", labels=["sidecar"]),
            "kv_used": GaugeMetricFamily("rollout_router_sidecar_kv_used_ratio", "the sidecar's KV cache in use, at "
                                         "its last /load (-1: unknown)", labels=["sidecar"]),
        }
        hits = CounterMetricFamily("rollout_router_sidecar_prefix_tokens", "the sidecar's prefix cache since its "
                                   "start: prompt tokens hit and looked up", labels=["sidecar", "kind"])
        state = GaugeMetricFamily("rollout_router_sidecar_state", "1 for the sidecar's state now",
                                  labels=["sidecar", "state"])
        for url, p in snap["sidecars"].items():
            for key, family in gauges.items():
                family.add_metric([url], float(p[key]))
            hits.add_metric([url, "hit"], float(p["prefix_hit_tokens"]))
            hits.add_metric([url, "query"], float(p["prefix_query_tokens"]))
            for name in STATES:
                state.add_metric([url, name], float(p["state"] == name))
        yield from gauges.values()
        yield hits
        yield state
