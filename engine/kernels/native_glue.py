"""The decoder layer's elementwise steps through engine/kernels/native/layer_glue.c (see its header):
the rotation and the cache writes in one call (both dtypes, torch's bits), and the residual add
with the norm, and silu times up (bf16; fp32 where a layer asks for them: a quantized engine's,
whose C decode loop runs the same, engine/models/native_layers.py). Each returns None where it does not
run (no C compiler, another device or dtype), and the caller takes torch's ops."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import native_kernels

# Set on a norm or an MLP whose fp32 glue runs in C (this module) rather than torch's ops: a quantized
# engine's (int8_linears.install) and a batch-invariant one's (model_loader), whose C decode loop
# (engine/models/native_layers.py) runs the same, so prefill and decode rows give the same bits. An fp32
# engine with batch_invariant off keeps torch's ops in its prefills: HF's arithmetic op for op.
C_GLUE = "_c_glue"



def glue_in_c(model: torch.nn.Module) -> None:
    """Every norm and MLP of `model` runs its fp32 glue in C (C_GLUE), as the C decode loop does: a row
    then has the same bits in a prefill step as in a decode step (batch invariance across step kinds)."""
    for module in model.modules():
        # a norm, an MLP (Llama's by their attributes; Gemma's mark themselves)
        if hasattr(module, "variance_epsilon") or hasattr(module, "act_fn") or getattr(module, "GLUE_IN_C", False):
            setattr(module, C_GLUE, True)


_I64, _PTR, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "rope_cache": (_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR,
                   _PTR),
    "add_rms_norm": (_PTR, _PTR, _PTR, _PTR, _F, _I64, _I64, _PTR),
    "silu_mul": (_PTR, _I64, _I64, _I64, _PTR),
    "gelu_tanh_mul": (_PTR, _I64, _I64, _I64, _PTR),
    "gemma_norm": (_PTR, _PTR, _F, _I64, _I64, _PTR),
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _fn(name: str, dtype: torch.dtype):
    if dtype not in _SUFFIX:
        return None
    return native_kernels.function("layer_glue", f"{name}_{_SUFFIX[dtype]}", _SIGNATURES[name])


def _rows(x: torch.Tensor) -> bool:
    """Whether x is [T, N] on the CPU with unit column stride (its rows may be a wider tensor's)."""
    return x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1


def rope_cache(q, k, v, cos, sin_signed, slots, k_slots, v_slots):
    """q [T, H, d], k and v [T, kvh, d] (rows possibly strided) rotated as fused_layers._rotate does (the
    first r values of each head, r = cos's width: d, or fewer for a partial rotary), k and v written at
    `slots` of the layer's cache slots [num_slots, kvh, d]: (q_rot, k_rot), or None."""
    fn = _fn("rope_cache", q.dtype)
    t, h, d = q.shape
    kvh, r = k.shape[1], cos.shape[-1]
    flat = [q.reshape(t, h * d) if q.stride(2) == 1 and q.stride(1) == d else None,
            k.reshape(t, kvh * d) if k.stride(2) == 1 and k.stride(1) == d else None,
            v.reshape(t, kvh * d) if v.stride(2) == 1 and v.stride(1) == d else None]
    if (fn is None or any(f is None or not _rows(f) for f in flat) or not k_slots.is_contiguous()
            or cos.dtype != q.dtype or not (cos.is_contiguous() and sin_signed.is_contiguous())
            or slots.dtype != torch.int64 or r % 2 or r > d):
        return None
    qf, kf, vf = flat
    q_out, k_out = torch.empty(t, h, d, dtype=q.dtype), torch.empty(t, kvh, d, dtype=q.dtype)
    fn(qf.data_ptr(), qf.stride(0), kf.data_ptr(), kf.stride(0), vf.data_ptr(), vf.stride(0), t, h, kvh, d, r,
       cos.data_ptr(), sin_signed.data_ptr(), slots.contiguous().data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(),
       q_out.data_ptr(), k_out.data_ptr())
    return q_out, k_out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """bf16 or fp32 [T, N]: (h, norm(h)) with h = x + residual (x itself without one), or None."""
    fn = _fn("add_rms_norm", x.dtype) if weight.dtype == x.dtype else None
    if fn is None or not x.is_contiguous() or x.dim() != 2 or x.device.type != "cpu":
        return None
    if residual is not None and not (residual.is_contiguous() and residual.shape == x.shape):
        return None
    t, n = x.shape
    h = torch.empty_like(x) if residual is not None else x
    out = torch.empty_like(x)
    fn(x.data_ptr(), None if residual is None else residual.data_ptr(), h.data_ptr(), weight.data_ptr(), eps, t, n,
       out.data_ptr())
    return h, out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, kernel: str = "silu_mul") -> torch.Tensor | None:
    """bf16 or fp32: silu(gate) * up (`kernel` "gelu_tanh_mul": GELU's tanh form), where gate and up are the
    two halves of one [T, 2I] tensor's rows (fused_linears' gate/up output), or None."""
    fn = _fn(kernel, gate.dtype)
    if fn is None or gate.dim() != 2 or not (_rows(gate) and _rows(up)) or gate.stride(0) != up.stride(0):
        return None
    t, i = gate.shape
    if up.data_ptr() != gate.data_ptr() + i * gate.element_size():
        return None
    out = torch.empty(t, i, dtype=gate.dtype)
    fn(gate.data_ptr(), gate.stride(0), t, i, out.data_ptr())
    return out


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """bf16 or fp32 [T, N]: Gemma's RMS norm of each row (scaled by 1 + weight), or None."""
    fn = _fn("gemma_norm", x.dtype) if weight.dtype == x.dtype else None
    if fn is None or not x.is_contiguous() or x.dim() != 2 or x.device.type != "cpu" or not weight.is_contiguous():
        return None
    out = torch.empty_like(x)
    fn(x.data_ptr(), weight.data_ptr(), eps, x.shape[0], x.shape[1], out.data_ptr())
    return out
