"""Decode attention through the C kernel engine/kernels/native/paged_decode.c (see its header for why):
the torch path's gather buffers and chunks are not made at all when it runs."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.kernels import native_kernels

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ENTRIES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


@dataclass
class NativeDecode:
    """A decode step's rows for the kernel: block tables [B, width] and key counts [B] (int64,
    on the CPU), and the longest row (the kernel's scratch per thread)."""

    block_table: torch.Tensor
    lengths: torch.Tensor
    max_len: int


_SIGNATURE = (_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float)


def _entry(dtype: torch.dtype):
    name = _ENTRIES.get(dtype)
    return None if name is None else native_kernels.function("paged_decode", name, _SIGNATURE, ctypes.c_int)


MAX_HEADS, HEAD_DIMS = 128, (16, 32, 64, 96, 128, 256)  # what the kernel takes (paged_decode.c; 96: Phi-3's)


def available(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether decode attention of a `dtype` cache on `device` with these heads runs in the kernel."""
    if device.type != "cpu" or heads % kv_heads or heads > MAX_HEADS or head_dim not in HEAD_DIMS:
        return False
    return _entry(dtype) is not None


def attend(nd: NativeDecode, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
           scale: float, window: int | None = None) -> torch.Tensor | None:
    """q [B, H, d] -> [B, H, d], attending each row's `lengths` keys in the cache
    ([num_blocks, bs, kvh, d] per layer), or its last `window` of them under a sliding window; None
    when the kernel does not take these shapes."""
    fn = _entry(q.dtype)
    if fn is None or k_blocks.dtype != q.dtype:
        return None
    q = q.contiguous()
    b, h, d = q.shape
    bs, kvh = k_blocks.shape[1], k_blocks.shape[2]
    out = torch.empty_like(q)
    rc = fn(q.data_ptr(), k_blocks.data_ptr(), v_blocks.data_ptr(), nd.block_table.data_ptr(),
            nd.block_table.stride(0), nd.lengths.data_ptr(), out.data_ptr(), b, h, kvh, d, bs, nd.max_len, window or 0,
            scale)
    return out if rc == 0 else None
