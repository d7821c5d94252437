"""What the trainer tells the sidecars' watchdogs about a push (WeightSyncGroup.mark_progress), so
that they can tell a trainer that stopped from one whose bytes are slow to be taken.

The mark is a count that moves while the trainer's push moves: one step for each bucket out, and
one for every MARK_EVERY_S the trainer spends waiting for the wire to take its bytes (`on_wire`: a
receiver that reads slowly, busy deriving copies or on a slow link, is not a trainer that
stalled). It stands still only while the trainer is stuck in its own code (a progress callback
that never returns, a gather that hangs) or frozen, and then a watchdog gives the push up after
its stall timeout. A frozen trainer's store does not answer either: that reads as no progress.

The count is written by one thread of its own at most every MARK_EVERY_S, so the transfer pays a
store round trip only that often. Terminal marks end it: SENT_MARK once the commit vote passed
(every worker holds every byte: what is left of the push is the engines' own work, which no
trainer can stall), FAILED_MARK when the trainer gave the push up, WITHDRAWN_MARK when it refused
the layout it reused and pushes again on a fresh one."""

from __future__ import annotations

import contextlib
import logging
import threading

from weight_sync.common.progress import FAILED_MARK, SENT_MARK, WITHDRAWN_MARK

log = logging.getLogger(__name__)


class ProgressMarks:
    MARK_EVERY_S = 0.5

    def __init__(self, group, push_id: str):
        self.group, self.push_id = group, push_id
        self.buckets = 0  # out so far (the sending thread's)
        self.ticks = 0  # MARK_EVERY_S periods spent waiting on the wire (the marking thread's)
        self._waiting = 0  # nesting depth of on_wire()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mark(0)

    def start(self) -> None:
        """Begin marking: the transfer starts."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="push-progress-marks", daemon=True)
            self._thread.start()

    def sent(self) -> None:
        """One more bucket is out."""
        self.buckets += 1

    @contextlib.contextmanager
    def on_wire(self):
        """The trainer waits for the wire to take its bytes: the count keeps moving meanwhile."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def done(self) -> None:
        """Every worker holds every byte (the commit vote passed)."""
        self._end(SENT_MARK)

    def failed(self) -> None:
        self._end(FAILED_MARK)

    def withdrawn(self) -> None:
        self._end(WITHDRAWN_MARK)

    def _end(self, mark: int) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._mark(mark)

    def _run(self) -> None:
        marked = 0
        while not self._stop.wait(self.MARK_EVERY_S):
            if self._waiting:
                self.ticks += 1
            if self.buckets + self.ticks != marked:
                marked = self.buckets + self.ticks
                self._mark(marked)

    def _mark(self, value: int) -> None:
        try:
            self.group.mark_progress(self.push_id, value)
        except Exception as e:  # noqa: BLE001 - a watchdog's hint: the push itself decides success
            log.debug("could not mark push %s progress: %s", self.push_id, e)
