"""Copies of an engine's served weights as push directories (weight_sync/common/push_dir.py),
written now or by a thread while the engine steps: how a restarted engine catches up from a
sibling or from the sidecar's host copy without the trainer.

On the CPU a background write reads the served weights themselves: a snapshot first would stop
the engine's loop for a copy of the weights right after each push (130-260 ms for SmolLM2's 538 MB
on 2 cores, a stall every streaming client saw at the switch) and write every byte twice. The
weights are not written while served (a swap commit re-points them); what could write the memory
a write reads (a later push's staging, a copy commit) waits for it first (`wait_readers`)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import msgspec
import torch

from weight_sync.common.push_dir import link_raw, withdraw, write_tensors

log = logging.getLogger(__name__)
BACKGROUND_NICE = 10  # a background write's thread yields the cores to the engine's steps


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
        # background writes reading the served weights (CPU), each with the storages it reads
        self.readers: list[tuple[threading.Thread, set[int]]] = []
        self.links: list[str] = []  # push directories linking the served weights' buffer (`link`)

    def link(self, served, file: str | None, path: str, version: int, digest: int | None) -> dict | None:
        """The served weights as a push directory with no byte copied (push_dir.link_raw): when they
        all lie in one staging buffer laid out as a push (`served`: (manifest, buffer), from
        ParamsTarget.served_whole) whose /dev/shm `file` a link can name from `path` (the same
        filesystem). None otherwise."""
        if served is None or file is None:
            return None
        t0 = time.perf_counter()
        m = msgspec.structs.replace(served[0], version=int(version))
        try:
            link_raw(path, file, m, digest)
        except OSError as e:  # on another filesystem than /dev/shm (EXDEV): written, as before
            log.debug("host copy at %s cannot link %s (%s): writing it", path, file, e)
            return None
        self.links = [p for p in self.links if os.path.isdir(p)] + [path]
        out = {"path": path, "bytes": m.layout_bytes, "seconds": time.perf_counter() - t0, "snapshot_seconds": 0.0,
               "linked": True}
        done = self.saves[path] = concurrent.futures.Future()  # as a background save answers: at once here
        done.set_result(out)
        return out

    def withdraw(self) -> None:
        """The served weights are about to be written in place (an in-place push, a copy commit,
        zero_weights): the push directories that link them stop being pushes first, so that no
        reader takes the half-written bytes for a version (a reader already reading them finds the
        digest changed: weight_sync/engine_side/local_receive.py's load_from_path)."""
        for path in self.links:
            withdraw(path)
        self.links = []

    def save(self, named, path: str, version: int, background: bool = False
             ) -> dict | concurrent.futures.Future:
        """Write `named` (name, tensor) pairs to `path`. `background=True`: only a host snapshot is
        taken here (on CUDA, copies queued on a side stream into pinned memory); a thread writes
        it, and the future returned resolves to the result once written (`saved(path)` asks
        without waiting)."""
        t0 = time.perf_counter()
        named = list(named)
        reads_served = background and not any(t.is_cuda for _, t in named)
        if reads_served:
            tensors, ready = {n: t.detach() for n, t in named}, None
        else:
            tensors, ready = host_snapshot(named)

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
            _yield_to_the_engine()
            try:
                done.set_result(write())
            except BaseException as e:  # noqa: BLE001 - handed to saved()
                done.set_exception(RuntimeError(f"writing the weights to {path} failed: {type(e).__name__}: {e}"))

        thread = threading.Thread(target=run, name="weight-sync-save", daemon=True)
        thread.start()
        if reads_served:
            storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
            self.readers = [r for r in self.readers if r[0].is_alive()] + [(thread, storages)]
        return done

    def wait_readers(self, memory: torch.Tensor | None = None) -> None:
        """Until no background write reads `memory`'s storage (None: any weights): called before
        anything writes memory that held served weights (a push's staging, a copy commit). A push
        taking the kept buffer waits only for a write of the version before the last."""
        ptr = None if memory is None else memory.untyped_storage().data_ptr()
        for thread, storages in list(self.readers):  # pruned by `save`: this may run on a receiving thread
            if ptr is None or ptr in storages:
                thread.join()

    def saved(self, path: str) -> dict | None:
        """A background save: None while it writes; its result once written; raises RuntimeError
        with its error if it failed (and forgets it either way)."""
        done = self.saves[path]
        if not done.done():
            return None
        del self.saves[path]
        return done.result()


def _yield_to_the_engine() -> None:
    """Lower this thread's scheduling priority (Linux: a thread's own nice value): the write is
    background work, and on a CPU whose cores the engine's threads fill it would slow the steps
    right after a push (measured: the first step after the switch took 2x the median)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: it writes at the engine's priority
        log.debug("host copy writes at normal priority: %s", e)
