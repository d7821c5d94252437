"""The sidecar's watch over a push's trainer while the engines receive (rollout/sidecar/push_coordinator.py):
a worker blocked in the trainer's transfer cannot be reached until the group's timeout (minutes),
so the sidecar watches the trainer from outside the group: its rendezvous port, and the progress
it marks in its store (weight_sync/trainer/progress_marks.py)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from engine import EngineClient
from weight_sync.common.progress import FAILED_MARK, SENT_MARK, PushProgress


def trainer_reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether the trainer that owns the group still listens on its rendezvous port (rank 0 hosts
    the group's store there for the group's life): a dead trainer's port refuses at once."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class Owner:
    """The trainer that owns the sidecar's weight sync, as its front end describes it."""

    group_name: str
    host: str | None  # where its group's store listens while it lives (None: no port to watch, an NCCL id)
    port: int | None
    # leave(engines, mid_push): the engines leave its group; mid_push: a transfer arriving is given up
    leave: Callable[[Sequence[EngineClient], bool], Awaitable[None]] = field(repr=False)
    store: dict | None = field(default=None, repr=False)  # its store, where its pushes mark progress (a secret)

    async def alive(self, timeout_s: float = 1.0) -> bool:
        return self.host is not None and await asyncio.to_thread(trainer_reachable, self.host, self.port, timeout_s)


class _ProgressMarks:
    """A push's progress as its trainer marks it in its store (weight_sync/trainer/progress_marks.py),
    read one at a time: a frozen trainer's store may never answer, and then reads as no progress.
    `sent`: the trainer's part is over (every byte out, the commit vote passed)."""

    def __init__(self, store: dict, push_id: str, period_s: float, stall_s: float):
        self.progress, self.period_s, self.stall_s = PushProgress(store, push_id, timeout_s=period_s), period_s, stall_s
        self.last, self.since, self.reading = None, time.monotonic(), None
        self.sent = False

    async def lost(self) -> str | None:
        """How the push cannot finish ("gave the push up", "made no progress ..."), or None."""
        if self.reading is None or self.reading.done():
            self.reading = asyncio.ensure_future(asyncio.to_thread(self.progress.read))
        await asyncio.wait({self.reading}, timeout=self.period_s)
        mark = "silent"  # a store that does not answer: no progress
        if self.reading.done() and self.reading.exception() is None:
            mark = self.reading.result()
        now = time.monotonic()
        if mark == FAILED_MARK:
            return "gave the push up"
        if mark == SENT_MARK:
            self.sent = True
            return None
        if mark is None or mark != self.last:
            self.last, self.since = mark, now
        elif now - self.since > self.stall_s:
            return f"made no progress for {self.stall_s:.0f} s"
        return None

    def close(self) -> None:
        if self.reading is not None:  # a read still waiting on a store that went: its error is expected
            self.reading.add_done_callback(lambda t: t.cancelled() or t.exception())


async def trainer_lost(owner: Owner, push_id: str, stall_s: float, period_s: float = 0.5, misses: int = 2) -> str:
    """During a push over the group the workers wait in the trainer's transfer, where nothing
    reaches them until the group's timeout (minutes). Three ways it cannot finish, noticed here:
    - the trainer is gone: its rendezvous port refuses twice in a row;
    - the trainer gave the push up (its broadcast failed: a peer of the group died): it marked
      the push failed (WeightSyncGroup.mark_progress);
    - the trainer stalled (frozen, or its link): its progress mark stood still, or its store was
      silent, for `stall_s` once the transfer began (the wait for every worker before it is the
      trainer's, bounded by its own timeout). The mark moves while the trainer waits for the wire to
      take its bytes, so a receiver that reads slowly does not look like a stalled trainer.
    The last two only for an owner whose pushes mark their progress (`store`). Once the trainer
    marked its part sent (every byte out, the commit vote passed), what is left is the engines'
    own work (derived copies of the weights): the trainer is watched no more, whatever it does.
    An owner with no port to watch is never seen lost here (NCCL's own error or the group's
    timeout ends the wait). Returns how it was lost."""
    if owner.host is None:
        await asyncio.Event().wait()
    if owner.store is not None:  # a no-op after the first push: the sidecar's front loads torch only here
        await asyncio.to_thread(PushProgress.load)
    marks = None if owner.store is None else _ProgressMarks(owner.store, push_id, period_s, stall_s)
    missed, why = 0, None
    try:
        while why is None:
            await asyncio.sleep(period_s)
            why = marks and await marks.lost()
            if marks is not None and marks.sent:
                break
            missed = 0 if await owner.alive(period_s) else missed + 1
            if missed >= misses:
                why = "is gone"
    finally:
        if marks is not None:
            marks.close()
    if why is None:
        await asyncio.Event().wait()  # sent: nothing the trainer does can lose this push now
    return f"the trainer of group {owner.group_name} {why} mid-push"
