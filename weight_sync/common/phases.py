"""Where a push's time goes, step by step, on either side (bench.push_scale prints them): `mark(name)`
closes the step that began at the previous mark; `add(name, seconds)` counts work timed inside a
step (packing, hashing, waiting on the wire) under a name of its own."""

from __future__ import annotations

import time


class Phases:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.add(name, now - self._t)
        self._t = now

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def timed(self, name: str, fn, *args):
        """`fn(*args)`, its seconds added under `name`."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.add(name, time.perf_counter() - t0)
