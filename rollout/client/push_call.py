"""One `push_weights` call: its choices as the push's steps take them (`PushCall`), and the handle
it returns when it returns early (`PushHandle`, wait=False)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class PushCall:
    """One push_weights call's choices, as run_push and the sidecars take them."""

    version: int
    pause_mode: str | None
    timeout_s: float
    progress: object  # progress(bucket, n_buckets) or None
    mode: str  # a PEFT model's: "adapter" or "merged"
    delta: bool | None
    sent: asyncio.Future | None = None  # wait=False: set once the trainer's bytes are out

    def mark_sent(self, _trainer=None) -> None:
        """The trainer's bytes are out (every engine holds them): a wait=False call returns now."""
        if self.sent is not None and not self.sent.done():
            self.sent.set_result(True)

    @property
    def on_sent(self):
        """run_push's `on_sent`: only a wait=False call waits for the bytes to be out."""
        return None if self.sent is None else self.mark_sent

    def bytes_out_early(self) -> bool:
        """A wait=False call's bytes went out: a failure after that is not tried again (they are gone)."""
        return self.sent is not None and self.sent.done()


class PushHandle:
    """A push that `push_weights(wait=False)` returned early: the trainer's bytes are out and the
    engines are swapping. `await handle` gives push_weights' result or raises its SidecarError."""

    def __init__(self, task: asyncio.Task, version: int):
        self.task, self.version = task, version

    def done(self) -> bool:
        return self.task.done()

    def __await__(self):
        return self.task.__await__()

    def __repr__(self) -> str:
        return f"PushHandle(version={self.version}, {'done' if self.done() else 'swapping'})"
