"""What an engine's memory holds, by part: the weights (each storage once: weights a push swapped
into one staging buffer count that buffer), the derived copies its forward reads instead of them
(engine/kernels/derived_weights.py: prepacked, 8-bit; none where a kernel reads the weights in place), and
the KV cache, its budget and the part of it resident now (engine/kernels/zero_pages.py: its pages are
taken as blocks are written). The sidecar reports it in health and /metrics, and logs it at start."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from engine.kernels import derived_weights
from engine.kernels.libc import mincore

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _nbytes(copy) -> int:
    if copy is None:
        return 0
    if isinstance(copy, torch.Tensor):
        return copy.numel() * copy.element_size()
    return int(getattr(copy, "nbytes", 0))


def derived_bytes(model: torch.nn.Module) -> int:
    """Bytes of the derived copies held now (a group's copy once), the spares a commit kept for the
    next push's included."""
    own = sum(_nbytes(m._derived) for m in derived_weights.derived_modules(model))
    kept = sum(_nbytes(c) for c in derived_weights.spares(model).values())
    return own + kept + sum(_nbytes(g.copy) for g in derived_weights.groups(model))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages the parameters live in, each once."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def resident_bytes(t: torch.Tensor | None) -> int:
    """Bytes of CPU tensor `t`'s storage whose pages are resident (mincore); its size where that
    cannot be asked (on a GPU: all of it)."""
    if t is None:
        return 0
    storage = t.untyped_storage()
    if t.device.type != "cpu" or mincore() is None or storage.nbytes() == 0:
        return storage.nbytes()
    start = storage.data_ptr() // _PAGE * _PAGE
    end = storage.data_ptr() + storage.nbytes()
    pages = -(-(end - start) // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if mincore()(start, end - start, vec) != 0:
        return storage.nbytes()
    return min(int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * _PAGE, storage.nbytes())


def engine_memory(model: torch.nn.Module, caches: list[torch.Tensor]) -> dict:
    """Bytes of the weights, their derived copies and the KV caches (`caches`: every group's keys and values)."""
    return {"weights": weight_bytes(model), "derived_copies": derived_bytes(model),
            "kv_cache": sum(t.numel() * t.element_size() for t in caches),
            "kv_cache_resident": sum(resident_bytes(t) for t in caches)}
