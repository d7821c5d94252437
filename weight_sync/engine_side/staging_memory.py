"""Staging memory for a push (weight_sync/engine_side/receive.py): how it is allocated, seen whole, kept
between pushes (`StagingPool`) and how much of it would fit (`free_bytes`)."""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import os
import threading
import time

import torch

from weight_sync.common.devices import normalize_device
from weight_sync.common.host_memory import alloc  # noqa: F401 - staging's allocator, as receive.py knows it
from weight_sync.engine_side import shared_buffers

log = logging.getLogger(__name__)

MARGIN = 64 << 20  # bytes left free beyond a staging copy: the allocator and the next step need some
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
BACKGROUND_NICE = 10  # ... on a thread that yields the cores to the engine's steps


def alloc_in_background(nbytes: int, device: torch.device) -> torch.Tensor:
    """Staging memory made ready by a background thread: as `alloc`, but its pages faulted in a
    chunk at a time (one MAP_POPULATE of gigabytes holds the process's memory map for its whole
    length, which stalls any allocation the engine's steps make meanwhile)."""
    if device.type != "cpu" or nbytes == 0:
        return alloc(nbytes, device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    shared_buffers.fault_in(t.data_ptr(), nbytes)
    return t


def drop_pages(t: torch.Tensor) -> int:
    """Gives the whole pages under CPU tensor `t`'s storage back to the kernel now
    (madvise(MADV_DONTNEED)); the mapping stays valid and reads as zeros, so a late write into
    it (a transfer that could not be stopped) faults in fresh pages instead of corrupting
    anything. Returns the bytes given back (0 off CPU, or where madvise is missing)."""
    if t.device.type != "cpu" or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    storage = t.untyped_storage()
    start = -(-storage.data_ptr() // _PAGE) * _PAGE  # whole pages only: never a neighbour's bytes
    end = (storage.data_ptr() + storage.nbytes()) // _PAGE * _PAGE
    if end <= start:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED) != 0:
        return 0
    return end - start


def whole(t, device=None) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `t` (a tensor or an UntypedStorage)."""
    storage = t.untyped_storage() if isinstance(t, torch.Tensor) else t
    return torch.empty(0, dtype=torch.uint8, device=device or storage.device).set_(storage)


def st_dtype(name: str) -> str:
    """safetensors dtype names -> ours."""
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
            "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}.get(name, name)


def free_bytes(device: torch.device) -> int:
    """Memory a new buffer could take now: on CUDA the device's free memory plus what the
    caching allocator holds unused; on CPU the kernel's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class StagingPool:
    """Where one worker's staging buffers come from and go back to. With `keep` (the default on
    CPU) a buffer a push no longer needs (an uncommitted staging buffer, the weights a swap
    replaced) is kept as the next push's, one at most: fresh pages cost page faults that on CPU
    are slower than the network (weight_sync/README.md); on CUDA the caching allocator already
    reuses freed blocks."""

    def __init__(self, device: torch.device, keep: bool, shared: bool = False):
        self.device = device
        self.keep = keep
        self.spare: torch.Tensor | None = None
        # CPU: buffers are files in /dev/shm (weight_sync/engine_side/shared_buffers.py), so that the one
        # the weights live in can be linked as a host copy; `files` names those still named, by address
        self.shared = shared and normalize_device(device).type == "cpu" and shared_buffers.available()
        self.files: dict[int, str] = {}
        if self.shared:  # a process that ends as it should leaves no names; a killed one's are swept
            atexit.register(self.keep_named, None)
        # called with the kept buffer before it is handed out: it held served weights, which a
        # background host copy may still be reading (weight_sync/engine_side/host_copy.py)
        self.before_reuse = lambda buf: None
        self._preparing: threading.Thread | None = None

    def prepare(self, nbytes: int) -> None:
        """Have a kept buffer of `nbytes` ready before a push needs one, made by a thread of its
        own while the engine serves (the push after a commit that freed no whole buffer of the
        pool's would otherwise fault its pages in on its path: 0.4-0.8 s a GB here). Does nothing
        when not keeping, or when such a buffer is kept or being made."""
        busy = self._preparing is not None and self._preparing.is_alive()
        if not self.keep or nbytes <= 0 or busy or (self.spare is not None and self.spare.numel() >= nbytes):
            return
        self._preparing = threading.Thread(target=self._prepare, args=(nbytes,), name="staging-prepare", daemon=True)
        self._preparing.start()

    def _prepare(self, nbytes: int) -> None:
        try:  # below the engine's steps, which it runs beside
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except (AttributeError, OSError):
            pass
        t0 = time.perf_counter()
        try:
            buf = self._new(nbytes, populate=False)
        except Exception as e:  # noqa: BLE001 - a push then allocates its own, as before
            log.warning("could not prepare %.1f MiB of staging memory: %s", nbytes / 2**20, e)
            return
        if self.keep and (self.spare is None or self.spare.numel() < nbytes):
            self._let_go(self.spare)
            self.spare = buf
        else:
            self._let_go(buf)
        log.debug("staging memory ready: %.1f MiB in %.2f s", nbytes / 2**20, time.perf_counter() - t0)

    def fresh(self, nbytes: int) -> torch.Tensor:
        """A buffer of the pool's kind that no push holds (its pages faulted in now)."""
        return self._new(nbytes)

    def _new(self, nbytes: int, populate: bool = True) -> torch.Tensor:
        if not self.shared or nbytes == 0:
            return alloc(nbytes, self.device) if populate else alloc_in_background(nbytes, self.device)
        t, path = shared_buffers.new_buffer(nbytes, populate)
        self.files[t.data_ptr()] = path
        return t

    def file_of(self, t: torch.Tensor) -> str | None:
        """The /dev/shm file of the pool's buffer under `t`, while it has a name."""
        return self.files.get(t.untyped_storage().data_ptr())

    def _let_go(self, t: torch.Tensor | None) -> None:
        """The pool lets buffer `t` go: its name goes now, its memory with its last view."""
        path = None if t is None else self.files.pop(t.untyped_storage().data_ptr(), None)
        if path is not None:
            shared_buffers.let_go(path)

    def keep_named(self, served: torch.Tensor | None) -> None:
        """After a commit: only `served` (the buffer every weight lives in now, if any: a host copy
        may link it) and the spare keep their names; the rest are let go (their memory goes when
        nothing views it: a LoRA base kept by reference, say)."""
        keep = {t.untyped_storage().data_ptr() for t in (served, self.spare) if t is not None}
        for ptr, path in list(self.files.items()):
            if ptr not in keep:
                del self.files[ptr]
                shared_buffers.let_go(path)

    def _wait_prepared(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def take(self, nbytes: int) -> torch.Tensor:
        self._wait_prepared()  # what is left of it costs less than a buffer of its own
        spare, self.spare = self.spare, None
        if spare is not None and spare.numel() >= nbytes and spare.device == normalize_device(self.device) \
                and not self._linked(spare):
            self.before_reuse(spare)
            return spare[:nbytes]
        self._let_go(spare)
        del spare
        return self._new(nbytes)

    def _linked(self, t: torch.Tensor) -> bool:
        """Whether a host copy still links `t`'s file: its bytes must stay as they are."""
        path = self.file_of(t)
        return path is not None and shared_buffers.linked(path)

    def give_back(self, buf: torch.Tensor | None) -> None:
        """`buf` (any view of it) is free again: kept whole for the next push, or let go."""
        if buf is not None and self.keep and self.spare is None:
            self.spare = whole(buf)
        else:
            self._let_go(buf)

    def set_keep(self, keep: bool) -> None:
        self.keep = keep
        if not keep:
            self.drop()

    def drop(self) -> None:
        """Let the kept buffer go (the group is left, or the weights are released)."""
        self._wait_prepared()
        self._let_go(self.spare)
        self.spare = None

    def room(self, nbytes: int, limit: int | None = None) -> dict:
        """Whether a staging copy of `nbytes` fits: a kept buffer that large, or free memory for it
        (plus a margin) within `limit`. {"fits", "free", "why"}."""
        if limit is not None and nbytes > limit:
            return {"fits": False, "free": None, "why": f"{nbytes / 2**20:.1f} MiB > the staging limit of "
                                                        f"{limit / 2**20:.1f} MiB"}
        if self.spare is not None and self.spare.numel() >= nbytes:
            return {"fits": True, "free": None, "why": "a kept staging buffer"}
        free = free_bytes(self.device)
        if free < nbytes + MARGIN:
            return {"fits": False, "free": free, "why": f"{nbytes / 2**20:.1f} MiB needed, {free / 2**20:.1f} MiB "
                                                        f"free on {self.device}"}
        return {"fits": True, "free": free, "why": ""}
