"""The LoRA merge's arithmetic, PEFT's own: `W = W0 + scale * B @ A`, bit for bit what
`LoraLayer.get_delta_weight` then `weight.data += delta` give on the same kind of device.

Pure functions on tensors, used by both halves: the engine (`engine/lora_bank.py`, unmerged
adapters) and weight_sync's adapter pushes (`weight_sync/trainer/lora_push.py`, `engine_side/lora_target.py`), which
import them from here: the engine never imports weight_sync.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch

from engine.kernels import native_kernels

log = logging.getLogger(__name__)


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
    dtype), into `out` when given (a buffer of W0's shape and dtype: no fresh memory, one pass over
    it where the native merge gives torch's bits, else two); W0 is left as it is.
    w0: [out, in], a: [r, in], b: [out, r]."""
    same = a.dtype == b.dtype == w0.dtype and not _through_fp32(b)
    fits = out is not None and out.shape == w0.shape and out.dtype == w0.dtype
    if fits and (same or (a.dtype == b.dtype == torch.float32 and w0.dtype == torch.bfloat16)):
        if _fused(a, b, scale, w0, out):
            return out
        # B @ A by torch's own mm (its bits), into a scratch kept per thread; then scaled and added
        # to W0, each step rounded once as torch's ops round (IEEE addition commutes: W0 + delta's
        # bits), into `out`: no fresh memory a merge. fp32 factors into a bf16 base (a trainer's
        # adapter into a bf16 engine) add in fp32 and round once, as PEFT's in-place add does.
        d = _scratch(w0.shape, b.dtype)
        torch.mm(b, a, out=d)
        add = _native_add() if w0.device.type == "cpu" and b.dtype == torch.float32 else None
        if add is not None and w0.is_contiguous() and out.is_contiguous():
            add(d.data_ptr(), scale, w0.data_ptr(), out.data_ptr(), w0.numel(), int(w0.dtype == torch.bfloat16))
            return out
        d.mul_(scale)
        return torch.add(w0, d, out=out)
    merged = w0.clone()
    merged += delta(a, b, scale)
    return merged


def _fused(a, b, scale: float, w0, out) -> bool:
    """The whole merge in one pass of engine/kernels/native/lora_merge.c (B @ A never written), where its
    sums are torch.mm's bits on this CPU (`fused_matches_mm`); False: not taken, nothing written."""
    ok = (w0.device.type == "cpu" and a.dtype == b.dtype == torch.float32 and w0.dtype in _FUSED_BASES
          and w0.is_contiguous() and out.is_contiguous() and fused_matches_mm())
    if ok:
        a, b = a.contiguous(), b.contiguous()
        _merge_rows()(b.data_ptr(), a.data_ptr(), w0.shape[0], a.shape[0], w0.shape[1], scale,
                      w0.data_ptr(), out.data_ptr(), int(w0.dtype == torch.bfloat16))
    return ok


_FUSED_BASES = (torch.float32, torch.bfloat16)


def _merge_rows():
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return native_kernels.function("lora_merge", "lora_merge_rows",
                                   (p, p, i64, i64, i64, ctypes.c_float, p, p, ctypes.c_int), None)


@functools.cache
def fused_matches_mm() -> bool:
    """Whether the one-pass merge gives torch's bits here: its B @ A is r FMAs in order, as MKL's
    sgemm sums a small K on the CPUs it was written on; another BLAS or CPU may sum otherwise, and
    then torch's mm (and a second pass) stays. Probed once a process on a few shapes and ranks."""
    if _merge_rows() is None:
        return False
    g = torch.Generator().manual_seed(0)
    for n, k, r in ((37, 70, 16), (64, 257, 8), (5, 1536, 32), (130, 48, 64), (576, 1536, 16)):
        w0, a, b = torch.randn(n, k, generator=g), torch.randn(r, k, generator=g), torch.randn(n, r, generator=g)
        want = torch.mm(b, a).mul_(0.37).add_(w0)
        got = torch.empty_like(w0)
        _merge_rows()(b.data_ptr(), a.data_ptr(), n, r, k, 0.37, w0.data_ptr(), got.data_ptr(), 0)
        if not torch.equal(got, want):
            log.info("LoRA merges in two passes: the one-pass sums are not torch.mm's bits on this CPU")
            return False
    return True


native_kernels.forget_with_kernels(fused_matches_mm.cache_clear)


def _native_add():
    """engine/kernels/native/lora_merge.c's one-pass scale-and-add (None: torch's ops)."""
    p = ctypes.c_void_p
    return native_kernels.function("lora_merge", "lora_add", (p, ctypes.c_float, p, p, ctypes.c_int64, ctypes.c_int))


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
