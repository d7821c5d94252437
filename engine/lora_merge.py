"""The LoRA merge's arithmetic, PEFT's own: `W = W0 + scale * B @ A`, bit for bit what
`LoraLayer.get_delta_weight` then `weight.data += delta` give on the same kind of device.

Pure functions on tensors, used by both halves: the engine (`engine/lora_bank.py`, unmerged
adapters) and weight_sync's adapter pushes (`weight_sync/trainer/lora_push.py`, `engine_side/lora_target.py`), which
import them from here: the engine never imports weight_sync.
"""

from __future__ import annotations

import threading

import torch


def _through_fp32(b: torch.Tensor) -> bool:
    """PEFT computes a 16-bit adapter's delta on a CPU in fp32 (slow 16-bit CPU matmuls)."""
    return b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`scale * B @ A` exactly as PEFT's LoraLayer.get_delta_weight computes it.
    a: [r, in] (lora_A), b: [out, r] (lora_B) -> [out, in], in b's dtype."""
    cast = _through_fp32(b)
    out = (b.float() @ a.float() if cast else b @ a) * scale
    return out.to(b.dtype) if cast else out


def merge(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """`W0 + delta` with PEFT's in-place add (`weight.data += delta`: rounded once, to W0's
    dtype), into `out` when given (a buffer of W0's shape and dtype: no fresh memory, two passes
    over it instead of four); W0 is left as it is. w0: [out, in], a: [r, in], b: [out, r]."""
    same = a.dtype == b.dtype == w0.dtype and not _through_fp32(b)
    fits = out is not None and out.shape == w0.shape and out.dtype == w0.dtype
    if fits and same:
        torch.mm(b, a, out=out)  # the same kernel as b @ a, then the same rounding steps:
        out.mul_(scale)          # (B @ A) * scale,
        return out.add_(w0)      # + W0 (IEEE addition commutes: the bits of W0 + delta)
    if fits and a.dtype == b.dtype and not _through_fp32(b) and a.dtype.itemsize >= w0.dtype.itemsize:
        # fp32 factors into a bf16 base (a trainer's adapter into a bf16 engine): the delta in the
        # factors' dtype in a scratch kept per thread, then added and rounded once into `out`, as
        # PEFT's in-place add does (it computes in the wider dtype): no fresh memory a merge
        d = _scratch(w0.shape, b.dtype)
        torch.mm(b, a, out=d)
        d.mul_(scale)
        return torch.add(w0, d, out=out)
    merged = w0.clone()
    merged += delta(a, b, scale)
    return merged


_scratches = threading.local()


def _scratch(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A [shape] buffer of `dtype`, the largest one asked for kept per thread (its memory: one
    linear's delta in fp32, a few MB)."""
    need, name = torch.Size(shape).numel(), str(dtype)
    buf = getattr(_scratches, name, None)
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=dtype)
        setattr(_scratches, name, buf)
    return buf[:need].view(shape)
