"""Gates in a group's store: a rank enters a collective only once every rank will.

A collective that some rank never joins waits out the transport's timeout (gloo's cannot be
interrupted: minutes), so a rank that goes while the group forms or before a push's manifest vote
would hold every other rank that long. Instead each rank first arrives at a gate, a few keys in
the trainer's store: the last to arrive opens it, and the trainer calls it off as soon as it
learns that a rank will not come (a sidecar's connection closed, a receiver failed). Every rank
waiting at a gate is then told at once, before any collective started.

A rank can also go after it arrived, while the others still come: the gate then opens on its
count. The forming gate's call-off therefore also ends the rendezvous that follows it (the
backend's own store waits, through `GatedStore`); a push's vote is a few milliseconds after its
gate, and what remains there is that window.

Two gates per group:

- `FORMING`: every rank, the trainer too, arrives before the backend's rendezvous (one per group:
  every generation of a group has a fresh store and prefix);
- a push's vote gate: the workers arrive (`arrive(store, push_gate(id), world_size - 1)`), the
  trainer waits for them, then opens or calls off the vote, and only then do the workers vote.
  The trainer alone decides: a call-off that races the last arrival can never let a worker vote
  alone.
"""

from __future__ import annotations

import datetime
import time

import torch

FORMING = "gate/form"
OPEN, OFF = b"ok", b"off"


def push_gate(push_id: str) -> str:
    return f"mark/{push_id}"


def decide(store, key: str, value: bytes) -> bytes:
    """Sets `key` to `value` unless it is set already; returns what it holds: the first decision wins."""
    return store.compare_set(key, b"", value)


def arrive(store, gate: str, count: int) -> None:
    """This rank reached `gate`; the `count`-th to arrive opens it (unless it was called off)."""
    if int(store.add(f"{gate}/arrived", 1)) == count:
        decide(store, f"{gate}/go", OPEN)


def call_off(store, gate: str) -> None:
    """Nobody passes `gate` (unless it opened already): every rank waiting at it, and any that
    arrives later, is told now. At a push's gate the workers' vote is called off first; past the
    forming gate, the rendezvous ends (`GatedStore`)."""
    decide(store, f"{gate}/vote", OFF)
    decide(store, f"{gate}/go", OFF)
    store.set(f"{gate}/off", OFF)


def wait_go(store, gate: str, timeout_s: float) -> bool:
    """Blocks until `gate` opened (True) or was called off (False); raises after `timeout_s` or
    when the store is gone (its trainer died). `store` must be a connection no other thread needs
    meanwhile: a store client serves one request at a time, and the call-off comes from another."""
    return _wait(store, f"{gate}/go", timeout_s)


def open_vote(store, gate: str, go: bool) -> bool:
    """The trainer, past a push's gate: lets the workers vote, or not; True if they vote (a
    call-off that came first wins)."""
    return decide(store, f"{gate}/vote", OPEN if go else OFF) == OPEN


def wait_vote(store, gate: str, timeout_s: float) -> bool:
    """A worker that arrived at a push's gate: True once the trainer opened the vote, False if the
    push was called off."""
    return _wait(store, f"{gate}/vote", timeout_s)


def forget(store, gate: str, *parts: str) -> None:
    """Drop `gate`'s keys (`parts` of them; all by default) once no rank reads them any more."""
    for part in parts or ("go", "arrived", "vote", "off"):
        store.delete_key(f"{gate}/{part}")


def _wait(store, key: str, timeout_s: float) -> bool:
    store.wait([key], datetime.timedelta(seconds=float(timeout_s)))
    return store.get(key) == OPEN


class GatedStore(torch.distributed.Store):
    """The store a backend forms on, past the forming gate: its blocking reads (the rendezvous's
    wait for every rank's address) poll `inner` and end with an error as soon as `gate` is called
    off in `watch`, not at the transport's timeout. Its other calls go straight to `inner`."""

    POLL_S = 0.02

    def __init__(self, inner, watch, gate: str, timeout_s: float):
        super().__init__()
        self.inner, self.watch, self.off_key, self.timeout_s = inner, watch, f"{gate}/off", float(timeout_s)

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        self.wait([key])
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        return self.inner.check(keys)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.timeout_s = timeout.total_seconds()

    def wait(self, keys, timeout=None):
        """Until every key is set; raises when the gate is called off, or after the timeout."""
        limit = self.timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        while not self.inner.check(keys):
            if self.watch.check([self.off_key]):
                raise RuntimeError("called off while forming: a rank of the group went")
            if time.monotonic() > deadline:
                raise TimeoutError(f"wait timeout after {limit * 1000:.0f}ms, keys: {keys}")
            time.sleep(self.POLL_S)
