"""The overlapped receive (a mixin of `WeightSyncExtension`, weight_sync/receiver.py): a push's
check, vote, buckets and commit vote on a thread of the worker's own while the engine keeps
stepping; `finish_staged_weights` then swaps the staged weights in between two steps. The
protocol, in weight_sync/README.md ("Overlapped receive")."""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from dataclasses import dataclass

import torch

from weight_sync.group import WeightSyncGroup
from weight_sync.staging_memory import drop_pages

log = logging.getLogger(__name__)

GIVE_UP_JOIN_S = 2.0  # off CPU: how long a give-up waits for the aborted transfer's thread to let go


@dataclass
class _Staged:
    """An overlapped push received on a thread of its own while the engine steps."""

    thread: threading.Thread
    group: WeightSyncGroup  # the group it arrives over (a later group's push may replace it)
    error: BaseException | None = None
    ready: tuple | None = None  # (manifest, staging buffer, commit plan, t0, t1, t2) once every byte is in
    staging: torch.Tensor | None = None  # the buffer its bytes arrive in, while the thread runs
    given_up: bool = False  # its group was left mid-transfer (close_weight_sync): its staging memory went


class OverlappedReceive:
    # -- RPC: overlapped pushes (the engine keeps stepping while the bytes arrive) --------------
    def begin_receive_weights(self, manifest, group_name: str | None = None) -> bool:
        """receive_weights' check, vote, buckets and commit vote, on a thread of its own: the
        engine's main loop keeps stepping with the current weights meanwhile. `staged_weights()`
        says when every byte is in; `finish_staged_weights(commit=True)` then swaps them in
        between two steps (a pointer swap: it does not grow with the model)."""
        st = self._ws()
        g = self._ws_group(group_name)
        old = st.staged
        if old is not None and old.group is g and old.thread.is_alive():
            raise RuntimeError("a push is already being received")
        if old is not None and old.ready is not None:  # never finished (its push was given up): its buffer goes
            self._ws_release(old.ready[1])
        staged = _Staged(threading.Thread(target=lambda: self._ws_stage(staged, g, manifest, group_name),
                                          name="weight-sync-receive", daemon=True), g)
        st.staged = staged
        staged.thread.start()
        return True

    def staged_weights(self) -> str:
        """"none", "receiving", "staged" (every byte in, the commit vote passed) or "failed"."""
        staged = self._ws().staged
        if staged is None:
            return "none"
        if staged.given_up:
            return "failed"
        if staged.thread.is_alive():
            return "receiving"
        return "failed" if staged.error is not None else "staged"

    def finish_staged_weights(self, commit: bool = True) -> dict:
        """Ends an overlapped push: raises its error if it failed (a refusal as PushRefused, as
        receive_weights would); else commits it (or, `commit=False`, drops it)."""
        st = self._ws()
        staged, st.staged = st.staged, None
        if staged is None or (staged.thread.is_alive() and not staged.given_up):
            st.staged = staged
            raise RuntimeError("no received push to finish" if staged is None else "the push is still arriving")
        if staged.error is not None:
            raise staged.error
        if staged.given_up:
            raise RuntimeError("the push was given up (its group was left) before it was finished")
        m, staging, plan, t0, t1, t2 = staged.ready
        if not commit:
            self._ws_release(staging)
            return {"dropped": m.version}
        self._ws_commit(m, staging, plan)
        return self._ws_done(m, t0, t1, t2, "broadcast, overlapped", len(m.buckets))

    def _ws_receive_stream(self):
        """The context the receiving thread runs in: on CUDA a stream of its own, so the staging
        buffer is allocated there and NCCL's waits order that stream, not the default one the
        forward runs on (a broadcast that never completes, from a dead trainer, would otherwise
        queue every step behind it until the group is aborted)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if getattr(self, "_ws_side_stream", None) is None:
            self._ws_side_stream = torch.cuda.Stream(self.device)
        # after what the engine queued so far: the staging a push reuses may be memory the
        # forward read before the last commit swapped it out
        self._ws_side_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._ws_side_stream)

    def _ws_stage(self, staged: _Staged, g: WeightSyncGroup, manifest, group_name: str | None) -> None:
        try:
            with self._ws_receive_stream():  # g.synchronize() then waits for this stream alone
                ready = self._ws_arrive(g, manifest, group_name, lambda staging: setattr(staged, "staging", staging))
            if not staged.given_up:
                staged.ready = ready
            del ready
        except BaseException as e:  # noqa: BLE001 - handed to finish_staged_weights
            traceback.clear_frames(e.__traceback__)  # its frames' locals hold the staging buffer
            staged.error = e
        finally:
            staged.staging = None
            if staged.given_up:
                g.close()  # here, not in the give-up: it may wait for gloo's last waits to time out

    def _ws_give_up(self, staged: _Staged) -> None:
        """An overlapped push whose group is left mid-transfer: its transfer is aborted and its
        staging memory given back now, not when the group's timeout ends the receiving thread
        (gloo's waits cannot be interrupted, and a dead trainer's may last that long too: see
        weight_sync/README.md, "Giving a push up"). The thread keeps the buffer's mapping, which
        a late bucket may still write into, until its group is closed."""
        staged.group.abort()  # NCCL: the thread's wait fails now
        staged.given_up = True
        staging = staged.staging if staged.ready is None else staged.ready[1]
        staged.ready = None
        if staging is not None:
            dropped = drop_pages(staging)
            log.info("a push given up mid-transfer: %.1f MiB of staging memory given back", dropped / 2**20)
        if self.device.type != "cpu":  # no pages to drop: the aborted thread frees its buffer as it ends
            staged.thread.join(GIVE_UP_JOIN_S)
