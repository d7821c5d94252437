"""The overlapped receive (a mixin of `WeightSyncExtension`, weight_sync/receiver.py): a push's
check, vote, buckets and commit vote on a thread of the worker's own while the engine keeps
stepping; `finish_staged_weights` then swaps the staged weights in between two steps. The
protocol, in weight_sync/README.md ("Overlapped receive")."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from weight_sync.group import WeightSyncGroup


@dataclass
class _Staged:
    """An overlapped push received on a thread of its own while the engine steps."""

    thread: threading.Thread
    group: "WeightSyncGroup"  # the group it arrives over (a later group's push may replace it)
    error: BaseException | None = None
    ready: tuple | None = None  # (manifest, staging buffer, commit plan, t0, t1, t2) once every byte is in


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
        if staged.thread.is_alive():
            return "receiving"
        return "failed" if staged.error is not None else "staged"

    def finish_staged_weights(self, commit: bool = True) -> dict:
        """Ends an overlapped push: raises its error if it failed (a refusal as PushRefused, as
        receive_weights would); else commits it (or, `commit=False`, drops it)."""
        st = self._ws()
        staged, st.staged = st.staged, None
        if staged is None or staged.thread.is_alive():
            st.staged = staged
            raise RuntimeError("no received push to finish" if staged is None else "the push is still arriving")
        if staged.error is not None:
            raise staged.error
        m, staging, plan, t0, t1, t2 = staged.ready
        if not commit:
            self._ws_release(staging)
            return {"dropped": m.version}
        self._ws_commit(m, staging, plan)
        return self._ws_done(m, t0, t1, t2, "broadcast, overlapped", len(m.buckets))

    def _ws_stage(self, staged: _Staged, g: WeightSyncGroup, manifest, group_name: str | None) -> None:
        try:
            staged.ready = self._ws_arrive(g, manifest, group_name)
        except BaseException as e:  # noqa: BLE001 - handed to finish_staged_weights
            staged.error = e
