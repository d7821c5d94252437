"""Large zero-filled host tensors whose memory is taken only as it is written: an anonymous mapping's
pages read as zeros and become resident at their first write. The KV cache is allocated this way on
the CPU, so an engine's resident memory (what a sidecar reports, and what an OOM killer weighs) is
the weights plus the cache blocks sequences have used, not the whole budget up front
(`torch.zeros` writes every page: 4 GiB resident from the start by default)."""

from __future__ import annotations

import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros(shape, dtype, device)`; on the CPU, resident only where written."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # keeps `buf` mapped
