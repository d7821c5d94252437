"""int8_linears' per-row steps through the C kernels of engine/kernels/native/quantize_rows.c, the same
bits in one call: quantizing the activations (eight torch ops a linear: a third of an int8
decode step on 2 cores) and multiplying their scales into the output (a mul_ and its casts); and
weight-only int8's copy of a weight, quantized and packed in one pass (quantize_groups.c)."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import amx_linears, native_kernels

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_SIGNATURES = {"quantize_rows": (_PTR, _I64, _I64, _PTR, _PTR), "scale_rows": (_PTR, _I64, _I64, _PTR),
               "quantize_groups": (_PTR, _I64, _I64, _PTR, _PTR)}


def _fn(dtype: torch.dtype, name: str = "quantize_rows", library: str = "quantize_rows"):
    if dtype not in _SUFFIX:
        return None
    return native_kernels.function(library, f"{name}_{_SUFFIX[dtype]}", _SIGNATURES[name])


def quantize_groups_packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Weight-only int8's copy of w [N, K] in one C pass (engine/kernels/native/quantize_groups.c): (packed
    uint8 [N/32, K/32, W8_CHUNK_BYTES], amx_linears.pack_w8's layout; scales bf16 [N, K/W8_GROUP]), the bits of
    int8_linears.quantize_groups then pack_w8; or None (no kernel for it here)."""
    fn = _fn(w.dtype, "quantize_groups", "quantize_groups") if w.device.type == "cpu" else None
    if fn is None:
        return None
    w = w.detach().contiguous()
    n, k = w.shape
    packed = torch.empty(-(-n // 32), -(-k // 32), amx_linears.W8_CHUNK_BYTES, dtype=torch.uint8)
    scales = torch.empty(n, -(-k // amx_linears.W8_GROUP), dtype=torch.bfloat16)
    fn(w.data_ptr(), n, k, packed.data_ptr(), scales.data_ptr())
    return packed, scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q int8 [M, K], scale fp32 [M, 1]) of a [M, K] CPU tensor, or None (no kernel for it here)."""
    fn = _fn(x.dtype) if x.device.type == "cpu" else None
    if fn is None:
        return None
    x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    fn(x.data_ptr(), rows, cols, q.data_ptr(), scale.data_ptr())
    return q, scale


def scale_rows_(out: torch.Tensor, scale: torch.Tensor) -> bool:
    """out [M, N] *= scale [M, 1] (fp32) in place, as torch's `out.mul_(scale)` rounds it; False
    (nothing done) where no kernel takes it."""
    fn = _fn(out.dtype, "scale_rows") if out.device.type == "cpu" and out.is_contiguous() else None
    if fn is None or scale.dtype != torch.float32 or not scale.is_contiguous():
        return False
    fn(out.data_ptr(), out.shape[0], out.shape[1], scale.data_ptr())
    return True
