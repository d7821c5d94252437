"""A push's buckets arriving into staging (weight_sync/engine_side/receive.py, step 3): at most
`max_inflight` receives posted at once, each bucket's tensors hashed as it lands, and what the
receive does meanwhile (copy a delta's base in, plan the commit) run while the first ones arrive."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from weight_sync.common.digest import Digest
from weight_sync.common.group import WeightSyncGroup
from weight_sync.common.manifest import Manifest
from weight_sync.common.phases import Phases


class BucketsIn:
    """Every bucket of `m` received over `g` into `staging`, laid out like the manifest.
    `hash_landed`: a full push's digest is taken bucket by bucket as each lands, while the next
    ones arrive (a delta's is of the weights it makes, taken after)."""

    def __init__(self, g: WeightSyncGroup, m: Manifest, staging: torch.Tensor, max_inflight: int,
                 hash_landed: bool, phases: Phases | None = None):
        self.g, self.m, self.staging, self.max_inflight = g, m, staging, max_inflight
        self.inflight: deque = deque()  # (work, bucket, bytes) of the receives posted
        self.received = 0  # bytes in so far
        self.landed = Digest() if hash_landed else None
        self.phases = phases or Phases()  # its waits on the wire and its hashing counted

    def receive(self, meanwhile: Callable[[], None]) -> None:
        """Every bucket in; `meanwhile()` is called once the first `max_inflight` are posted (and
        again once all are: it must do its work once)."""
        for k, b in enumerate(self.m.buckets):
            if b.nbytes == 0:
                continue
            if len(self.inflight) >= self.max_inflight:
                meanwhile()
            while len(self.inflight) >= self.max_inflight:
                self._retire()
            self.inflight.append((self.g.fan_out(self.staging[b.start:b.end]), k, b.nbytes))
        meanwhile()
        while self.inflight:
            self._retire()
        self.g.synchronize()

    def digest(self) -> int:
        return self.landed.value()

    def _retire(self) -> None:
        work, k, nbytes = self.inflight.popleft()
        self.phases.timed("wire_wait", self.g.wait, work, f"receiving bucket {k}")
        if self.landed is not None:
            self.phases.timed("hash", self._hash, self.m.buckets[k])
        self.received += nbytes

    def _hash(self, b) -> None:
        for t in self.m.tensors[b.first:b.last]:
            self.landed.add(self.staging[t.offset:t.offset + t.nbytes])


class Meanwhile:
    """What a receive does while its first buckets arrive, each job run once; `planner`'s result
    is kept with the seconds it took (`plan`: None until it ran)."""

    def __init__(self, jobs: list, planner: Callable):
        self.jobs, self.planner = [f for f in jobs if f], planner
        self.plan: tuple | None = None

    def run(self) -> None:
        while self.jobs:
            f = self.jobs.pop(0)
            if f is self.planner:
                self.plan = timed(f)
            else:
                f()


def timed(fn, *args) -> tuple:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
