"""Copies of an engine's served weights as push directories (weight_sync/common/push_dir.py),
written now or by a thread while the engine steps: how a restarted engine catches up from a
sibling or from the sidecar's host copy without the trainer."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import torch

from weight_sync.common.push_dir import write_tensors


def host_snapshot(named) -> tuple[dict[str, torch.Tensor], object]:
    """A copy of (name, tensor) pairs in host memory, for writing in the background while the
    engine goes on (and a later push changes its weights). On CUDA: pinned buffers filled on a
    stream of their own, so the engine's thread only queues the copies; returns the event that
    marks them done (None on CPU, where the copy is made here)."""
    cuda = [t for _, t in named if t.is_cuda]
    if not cuda:
        return {n: t.detach().clone() for n, t in named}, None
    device = cuda[0].device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))  # after the commit that made these weights
    out = {}
    with torch.cuda.stream(side):
        for n, t in named:
            out[n] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach(), non_blocking=True)
            t.record_stream(side)
    done = torch.cuda.Event()
    done.record(side)
    return out, done


class HostCopies:
    def __init__(self):
        self.saves: dict[str, concurrent.futures.Future] = {}  # path -> a background write's outcome

    def save(self, named, path: str, version: int, background: bool = False
             ) -> dict | concurrent.futures.Future:
        """Write `named` (name, tensor) pairs to `path`. `background=True`: only a host snapshot is
        taken here (on CUDA, copies queued on a side stream into pinned memory); a thread writes
        it, and the future returned resolves to the result once written (`saved(path)` asks
        without waiting)."""
        t0 = time.perf_counter()
        tensors, ready = host_snapshot(list(named))

        snapshot_s = time.perf_counter() - t0

        def write() -> dict:
            m = write_tensors(tensors, path, version, ready)
            return {"path": path, "bytes": m.layout_bytes, "seconds": time.perf_counter() - t0,
                    "snapshot_seconds": snapshot_s}

        if not background:
            return write()
        self.saves = {p: f for p, f in self.saves.items() if not f.done()}  # answered through their futures
        done = self.saves[path] = concurrent.futures.Future()

        def run():
            try:
                done.set_result(write())
            except BaseException as e:  # noqa: BLE001 - handed to saved()
                done.set_exception(RuntimeError(f"writing the weights to {path} failed: {type(e).__name__}: {e}"))

        threading.Thread(target=run, name="weight-sync-save", daemon=True).start()
        return done

    def saved(self, path: str) -> dict | None:
        """A background save: None while it writes; its result once written; raises RuntimeError
        with its error if it failed (and forgets it either way)."""
        done = self.saves[path]
        if not done.done():
            return None
        del self.saves[path]
        return done.result()
