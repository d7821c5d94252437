"""GET /metrics: the sidecar's counters in Prometheus' text format (prometheus_client), read from
the manager at scrape time, plus the HTTP front's own: requests by path and status, and time to
first token of streamed requests."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout.sidecar.load_report import load_report
from rollout.sidecar.memory import PARTS

# (stats key, metric name, help, kind)
_FROM_STATS = [
    ("generated_tokens", "rollout_generated_tokens", "tokens generated (ZMQ and HTTP)", "counter"),
    ("rollouts", "rollout_samples", "samples finished", "counter"),
    ("tokens_per_s", "rollout_tokens_per_second", "tokens generated per second since start", "gauge"),
    ("groups_in_flight", "rollout_groups_in_flight", "prompts being generated now", "gauge"),
    ("queue_depth", "rollout_sequences_in_flight", "sequences on the engines now", "gauge"),
    ("pushes", "rollout_weight_pushes", "weight pushes committed", "counter"),
    ("failed_pushes", "rollout_weight_pushes_failed", "weight pushes that failed", "counter"),
    ("pause_seconds", "rollout_pause_seconds", "seconds the engines were paused for pushes", "counter"),
    ("transfer_seconds", "rollout_transfer_seconds", "seconds spent receiving weights", "counter"),
    ("version", "rollout_weight_version", "weight version served", "gauge"),
    ("engine_restarts", "rollout_engine_restarts", "engines restarted after dying", "counter"),
]

# (load report field, metric name, help): what routers place sessions by (rollout/sidecar/load_report.py)
_FROM_LOAD = [
    ("running", "rollout_sequences_running", "sequences the engines schedule now"),
    ("waiting", "rollout_sequences_waiting", "sequences queued on the engines (no KV room yet, or held)"),
    ("kv_used", "rollout_kv_cache_used_ratio", "the share of KV cache blocks in use"),
]


class _ManagerCollector:
    def __init__(self, manager):
        self.manager = manager
        self.engine_states: list = []  # the last health reply's (FrontMetrics.refresh)
        self.load = None  # the last load report (rollout/sidecar/load_report.py)

    def collect(self):
        stats = self.manager.stats()
        for key, name, doc, kind in _FROM_STATS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, doc, value=float(stats[key]))
        memory = GaugeMetricFamily("rollout_memory_bytes", "an engine's memory by part (rollout/sidecar/memory.py)",
                                   labels=["engine", "part"])
        for i, state in enumerate(self.engine_states):
            for part in PARTS:
                if state.memory and part in state.memory:
                    memory.add_metric([str(i), part], float(state.memory[part]))
        yield memory
        prefix = CounterMetricFamily("rollout_prefix_cache", "an engine's prefix cache since start: tokens hit, "
                                     "looked up, hit on another weight version's blocks (asked for), and blocks "
                                     "forgotten by resets (engine/block_manager.py)", labels=["engine", "kind"])
        for i, state in enumerate(self.engine_states):
            for kind, value in (state.prefix_cache or {}).items():
                prefix.add_metric([str(i), kind], float(value))
        yield prefix
        if self.load is not None:
            for key, name, doc in _FROM_LOAD:
                if getattr(self.load, key) >= 0:
                    yield GaugeMetricFamily(name, doc, value=float(getattr(self.load, key)))


class FrontMetrics:
    def __init__(self, manager):
        self.registry = CollectorRegistry()
        self._collector = _ManagerCollector(manager)
        self.registry.register(self._collector)
        self.requests = Counter("http_requests", "HTTP requests answered", ["path", "status"], registry=self.registry)
        self.ttft = Histogram("time_to_first_token_seconds", "streamed requests: request to first token",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)

    def request_done(self, path: str, status: int) -> None:
        known = path if path.startswith("/v1/") or path in ("/health", "/load", "/metrics", "/inference/v1/generate") \
            else "other"
        self.requests.labels(known, str(status)).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    async def refresh(self) -> None:
        """Each engine's memory as a health check reports it now, and the load (for the next render)."""
        self._collector.engine_states = (await self._collector.manager.health(timeout=5.0)).engine_states
        self._collector.load = await load_report(self._collector.manager)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
