"""What a sidecar knows about itself, in one object: the weight version it serves, its counters,
the push lock and what is in flight. One `SidecarState` is made with the `RolloutManager` and
handed whole to what shares it (the weight-push coordinator rollout.sidecar.push_coordinator, the streamed
groups rollout.sidecar.group_stream, the supervisor rollout.sidecar.supervision), as nano-vllm hands its Config whole.
They change it only through its methods, so each change has one spelling and one place to find."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

# the counters stats() reports, by name (the sidecar's protocol: clients read them by these names)
COUNTERS = (
    "generated_tokens", "rollouts", "groups_in_flight", "pushes", "push_seconds", "transfer_seconds",
    "pause_seconds", "pause_wait_seconds", "aborted_resubmitted", "stale_restarts", "stale_returned",
    "failed_pushes", "engine_deaths", "engine_restarts", "resubmitted_after_engine_death", "inplace_pushes",
)
_SECONDS = {name for name in COUNTERS if name.endswith("_seconds")}


class SidecarState:
    def __init__(self):
        self._version = 0
        self._counters = {name: 0.0 if name in _SECONDS else 0 for name in COUNTERS}
        # one weight change at a time: a push's pause and commit, an engine's catch-up after a restart
        self.push_lock = asyncio.Lock()
        self._receiving = 0  # overlapped pushes whose bytes arrive while the engines generate
        self.streams: set[asyncio.Queue] = set()  # streamed groups' queues, ended at shutdown
        self.started = time.monotonic()

    @property
    def version(self) -> int:
        """The newest weight version every serving engine holds."""
        return self._version

    def committed(self, version: int) -> None:
        """Every engine that is up committed `version` (a push, a load)."""
        self._version = version

    @property
    def counters(self) -> dict:
        """A copy: counts change through `count` only."""
        return dict(self._counters)

    def counter(self, name: str):
        return self._counters[name]

    def count(self, name: str, by: float = 1) -> None:
        self._counters[name] += by

    @contextmanager
    def in_flight(self, name: str) -> Iterator[None]:
        """Counts one more of `name` (say "groups_in_flight") for the body's duration."""
        self._counters[name] += 1
        try:
            yield
        finally:
            self._counters[name] -= 1

    @contextmanager
    def receiving(self) -> Iterator[None]:
        """An overlapped push's bytes arriving: health says "pushing" meanwhile."""
        self._receiving += 1
        try:
            yield
        finally:
            self._receiving -= 1

    @property
    def pushing(self) -> bool:
        return self.push_lock.locked() or self._receiving > 0

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started
