"""Staging buffers that are files in /dev/shm (CPU), so that the buffer a push committed, which the
weights then live in, can be the sidecar's host copy without a copy: a hard link to its file in a
push directory (weight_sync/common/push_dir.py's raw form) keeps those bytes for a restarted engine
when this one dies. Before, each push's host copy was a second write of the whole model into
/dev/shm by a background thread (1x the model's bytes more, and 2x while the next one replaced it;
the push after had to wait for the write to let go of its buffer: seconds at 1.7B).

A buffer's file is named for its engine (`owned_name`: the supervisor sweeps a dead engine's) and
mapped shared; its name goes as soon as the pool lets the buffer go (the memory follows when the
last view of it does), so only the served buffer and the kept spare have names. A buffer another
name links (a host copy) is never written again: a push does not stage into it (`linked`), and an
in-place write of the served weights withdraws the links first (`withdraw`)."""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from engine.kernels import huge_pages
from weight_sync.common.shm_names import SHM_DIR, STAGING_PREFIX, _remove, owned_name

log = logging.getLogger(__name__)
TOUCH_CHUNK = 64 << 20  # pages faulted in this many bytes at a time, off a push's path


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def new_buffer(nbytes: int, populate: bool = True) -> tuple[torch.Tensor, str]:
    """A uint8 CPU tensor of `nbytes` over a fresh file in /dev/shm, and the file's path. Its pages
    are provided now: in one go (`populate`: MAP_POPULATE), or a chunk at a time by this thread
    (a background preparation: one MAP_POPULATE of gigabytes holds the process's memory map for its
    whole length, stalling whatever the engine's steps allocate meanwhile)."""
    path = os.path.join(SHM_DIR, owned_name(STAGING_PREFIX))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        t = huge_pages.map_shared(fd, nbytes, populate)  # from a 2 MB boundary: its pages can go onto huge pages
    except BaseException:
        _remove(path)
        raise
    finally:
        os.close(fd)  # the mapping keeps the file
    if not populate:
        fault_in(t.data_ptr(), nbytes)
    return t, path


MADV_POPULATE_WRITE = 23  # Linux 5.14: the pages provided writable, without a write of ours


def fault_in(address: int, nbytes: int) -> None:
    """Provide the pages of [address, address + nbytes) a chunk at a time (ctypes lets the GIL go
    during each call): madvise(MADV_POPULATE_WRITE) where the kernel has it (one pass, about twice
    as fast as writing them), else a memset."""
    madvise = huge_pages.madvise()
    for start in range(0, nbytes, TOUCH_CHUNK):
        size = min(TOUCH_CHUNK, nbytes - start)
        if madvise is None or madvise(address + start, size, MADV_POPULATE_WRITE) != 0:
            ctypes.memset(address + start, 0, size)


def linked(path: str) -> bool:
    """Whether another name links this buffer's file (a host copy): its bytes must not change."""
    try:
        return os.stat(path).st_nlink > 1
    except FileNotFoundError:
        return False


def let_go(path: str) -> None:
    """The buffer's name goes: its memory is freed once no view maps it and no link names it."""
    _remove(path)
