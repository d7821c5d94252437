"""The overlapped receive: a push's check, vote, buckets and commit vote (`PushReceiver.arrive`) on a
thread of the worker's own while the engine keeps stepping; `finish` then swaps the staged weights
in between two steps (`PushReceiver.commit`). The protocol, in weight_sync/README.md ("Overlapped
receive"). It is the layer above the receiver: it calls the receiver, never the other way round,
and it is the one that leaves a group, since only it knows whether a push still arrives over it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import traceback
from dataclasses import dataclass, field

import torch

from weight_sync.common.group import WeightSyncGroup
from weight_sync.engine_side.receive import Arrived, PushReceiver
from weight_sync.engine_side.staging_memory import drop_pages

log = logging.getLogger(__name__)

GIVE_UP_JOIN_S = 2.0  # off CPU: how long a give-up waits for the aborted transfer's thread to let go


@dataclass
class StagedPush:
    """An overlapped push received on a thread of its own while the engine steps."""

    group: WeightSyncGroup  # the group it arrives over (a later group's push may replace it)
    thread: threading.Thread | None = None
    error: BaseException | None = None
    ready: Arrived | None = None  # once every byte is in
    staging: torch.Tensor | None = None  # the buffer its bytes arrive in, while the thread runs
    given_up: bool = False  # its group was left mid-transfer: its staging memory went
    arrived: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # its state, once known

    @property
    def arriving(self) -> bool:
        """Its bytes still arrive. Read from its settled state, not from its thread: the thread lives
        on a moment after settling it, and a finish asked for in that moment must find it staged."""
        return not self.arrived.done()

    @property
    def state(self) -> str:
        if self.given_up:
            return "failed"
        if self.arriving:
            return "receiving"
        return "failed" if self.error is not None else "staged"


class OverlappedReceive:
    def __init__(self, receiver: PushReceiver):
        self.receiver = receiver
        self.staged: StagedPush | None = None
        self.side_stream = None  # CUDA: the receiving thread's stream

    def begin(self, manifest, group_name: str | None = None, foreign: bool = False) -> concurrent.futures.Future:
        """Start steps 1-4 on a thread; the engine keeps stepping with the current weights. The
        future resolves to "staged" (every byte in, the commit vote passed) or "failed" (`finish`
        raises why) once the thread ends. `foreign`: over a foreign trainer's group (vLLM's RL routes'
        or SGLang's: the receiver's `foreign_group`), which casts no vote."""
        if foreign:
            g = self.receiver.foreign_group
            if g is None or not g.ready:
                raise RuntimeError("no vLLM weight-transfer group: /init_weight_transfer_engine first")
        else:
            g = self.receiver.group_for(group_name)
        old = self.staged
        if old is not None and old.group is g and old.arriving:
            raise RuntimeError("a push is already being received")
        if old is not None and old.ready is not None:  # never finished (its push was given up): its buffer goes
            self.receiver.pool.give_back(old.ready.plan.staging)
        staged = self.staged = StagedPush(g)
        staged.thread = threading.Thread(target=self._stage, args=(staged, manifest, group_name, foreign),
                                         name="weight-sync-receive", daemon=True)
        staged.thread.start()
        return staged.arrived

    def state(self) -> str:
        """"none", "receiving", "staged" or "failed"."""
        return "none" if self.staged is None else self.staged.state

    def finish(self, commit: bool = True) -> dict:
        """Ends an overlapped push: raises its error if it failed (a refusal as PushRefused, as
        `PushReceiver.receive` would); else commits it (or, `commit=False`, drops it)."""
        staged, self.staged = self.staged, None
        if staged is None or (staged.arriving and not staged.given_up):
            self.staged = staged
            raise RuntimeError("no received push to finish" if staged is None else "the push is still arriving")
        if staged.error is not None:
            raise staged.error
        if staged.given_up:
            raise RuntimeError("the push was given up (its group was left) before it was finished")
        if not commit:
            self.receiver.pool.give_back(staged.ready.plan.staging)
            return {"dropped": staged.ready.m.version}
        return self.receiver.commit(staged.ready, "broadcast, overlapped")

    def take_staged(self):
        """The staged push, received and checked but not committed, handed to the caller (an
        update in parts: weight_sync/engine_side/held_parts.py); raises as `finish` would."""
        staged, self.staged = self.staged, None
        if staged is None or (staged.arriving and not staged.given_up):
            self.staged = staged
            raise RuntimeError("no received push to hold" if staged is None else "the push is still arriving")
        if staged.error is not None:
            raise staged.error
        if staged.given_up or staged.ready is None:
            raise RuntimeError("the push was given up (its group was left) before it was held")
        return staged.ready

    def close(self, drop_staging: bool = True) -> None:
        """Leave the group (if any). An overlapped push still arriving over it is given up: its
        staging memory goes now. `drop_staging` frees kept staging memory too."""
        r = self.receiver
        g, r.group = r.group, None
        staged = self.staged
        if staged is not None and staged.group is g and staged.arriving:
            self._give_up(staged)
        elif g is not None:
            g.close()
        if drop_staging:
            r.pool.drop()
            r.shared.drop()
            if staged is not None and not staged.arriving:
                self.staged = None  # a push staged but never finished: nobody will commit it now

    def receive_stream(self):
        """The context the receiving thread runs in: on CUDA a stream of its own, so the staging
        buffer is allocated there and NCCL's waits order that stream, not the default one the
        forward runs on (a broadcast that never completes, from a dead trainer, would otherwise
        queue every step behind it until the group is aborted)."""
        device = self.receiver.device
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(device)
        # after what the engine queued so far: the staging a push reuses may be memory the
        # forward read before the last commit swapped it out
        self.side_stream.wait_stream(torch.cuda.current_stream(device))
        return torch.cuda.stream(self.side_stream)

    def _stage(self, staged: StagedPush, manifest, group_name: str | None, foreign: bool = False) -> None:
        g = staged.group
        keep = lambda staging: setattr(staged, "staging", staging)  # noqa: E731
        try:
            with self.receive_stream():  # g.synchronize() then waits for this stream alone
                if foreign:
                    ready = self.receiver.arrive_foreign(g, manifest, keep)
                else:
                    ready = self.receiver.arrive(g, manifest, group_name, keep)
            if not staged.given_up:
                staged.ready = ready
            del ready
        except BaseException as e:  # noqa: BLE001 - handed to finish
            traceback.clear_frames(e.__traceback__)  # its frames' locals hold the staging buffer
            staged.error = e
        finally:
            staged.staging = None
            if staged.given_up:
                g.close()  # here, not in the give-up: it may wait for gloo's last waits to time out
        _settle(staged)

    def _give_up(self, staged: StagedPush) -> None:
        """An overlapped push whose group is left mid-transfer: its transfer is aborted and its
        staging memory given back now, not when the group's timeout ends the receiving thread
        (gloo's waits cannot be interrupted, and a dead trainer's may last that long too: see
        weight_sync/README.md, "Giving a push up"). The thread keeps the buffer's mapping, which
        a late bucket may still write into, until its group is closed."""
        staged.group.abort()  # NCCL: the thread's wait fails now
        staged.given_up = True
        _settle(staged)  # whoever waits for it learns now, not when gloo's wait ends
        staging = staged.staging if staged.ready is None else staged.ready.plan.staging
        staged.ready = None
        if staging is not None:
            dropped = drop_pages(staging)
            log.info("a push given up mid-transfer: %.1f MiB of staging memory given back", dropped / 2**20)
        if self.receiver.device.type != "cpu":  # no pages to drop: the aborted thread frees its buffer as it ends
            staged.thread.join(GIVE_UP_JOIN_S)


def _settle(staged: StagedPush) -> None:
    """Resolve `staged.arrived` with its state, once (the thread's end and a give-up may race)."""
    try:
        staged.arrived.set_result("failed" if staged.error is not None or staged.given_up else "staged")
    except concurrent.futures.InvalidStateError:
        pass
