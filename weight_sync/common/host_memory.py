"""Large host buffers whose pages are provided in one go: what staging (weight_sync/engine_side/staging_memory.py)
and a trainer's kept delta base (weight_sync/trainer/delta_encode.py) allocate. No torch import at
module load beyond what callers have."""

from __future__ import annotations

import mmap

import torch


def alloc(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of `nbytes`. On CPU, an anonymous mapping populated up front (MAP_POPULATE):
    the kernel provides the pages in one go instead of faulting them in one by one as they are first
    written (measured: about 2x cheaper for a fresh 2 GB buffer on the benchmark VM)."""
    if device.type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_POPULATE"):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive; unmapped when the last view goes
