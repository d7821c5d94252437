"""Weight-only int8 on a CPU without AMX tiles: engine/kernels/native/w8_linear.c, on amx_linears.pack_w8's
copy (int8 weights, a bf16 scale per 16 values of K of each column), so the int8 engine is one scheme on
every CPU: the activations are never rounded to 8 bits (int8_linears says what that costs).

It multiplies the int8 weights as integers by each row's activations rounded to int16 (exact within 2^7
of the row's largest value, else within 2^-15 of it; `int16_rows`), each weight q * scale exactly: on
AVX512-VNNI's VPDPWSSD (AMD Zen 4 and 5, Intel Ice Lake and later; 32 products an instruction, as
VDPBF16PS does) or AVX2's VPMADDWD (AMD Zen 3, Intel Haswell and later; 16 a uop where the bf16 engine's
FMAs do 8), the same bits on both (w8_madd.h). Where a step reads more bytes than it multiplies the copy
streams 0.56 of the bf16 weights' bytes: on a Zen 3 1.42-1.60x the bf16 engine's linears at 1-8 rows and
1.26-1.51x at 32; on a Zen 4 the int8 engine 1.30-1.31x the bf16 engine's tokens/s at 8 sequences,
1.05-1.07x at 32 (Llama-3.2-1B's and Qwen3-1.7B's shapes; bench/RESULTS.md, docs/guides/int8.md).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels import amx_linears, native_kernels

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGS = (_PTR, _I64, _I64, _PTR, _I64, _PTR)


@functools.cache
def available() -> bool:
    """Whether w8_linear.c runs here (AVX2 with FMA, which every AVX-512 CPU has; its library built)."""
    return {"avx2", "fma"} <= native_kernels.cpu_flags() and _fn(torch.bfloat16) is not None


native_kernels.forget_with_kernels(available.cache_clear)


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    """The values the integer kernel multiplies for bf16 rows x [m, k]: each row times 2^(14 - e), where
    2^e <= its largest |x| < 2^(e + 1), rounded to an integer (ties to even), and scaled back (fp64). Pure."""
    x = x.double()
    top = x.abs().amax(dim=1, keepdim=True)
    e = torch.where(top > 0, torch.frexp(top).exponent - 1, 0).clamp(min=-126)
    return torch.ldexp(torch.round(torch.ldexp(x, 14 - e)), e - 14)


def _fn(out_dtype: torch.dtype):
    symbol = "w8_linear_bf16" if out_dtype == torch.bfloat16 else "w8_linear_f32"
    return native_kernels.function("w8_linear", symbol, _ARGS, ctypes.c_int)


def linear_w8(x: torch.Tensor, w: amx_linears.AmxWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """x [m, k] bf16 @ (w `pack_w8`ed: each weight q * scale, rounded to bf16).T, summed in fp32 and
    rounded once to out_dtype (fp32 or bf16): amx_linears.linear_w8's arithmetic without the tiles."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=out_dtype)
    rc = _fn(out_dtype)(x.data_ptr(), x.shape[0], w.k, w.packed.data_ptr(), w.n, out.data_ptr())
    if rc != 0:
        raise MemoryError("w8_linear: no memory for its widened weights or activations")
    return out


def c_kernels() -> tuple[tuple[str, str], tuple[str, str]]:
    """(library, symbol) of the bf16-out and fp32-out weight-only kernels, for the C decode loop's table:
    the AMX kernel where it runs, else this one."""
    if amx_linears.available():
        return ("amx_linear", "amx_linear_w8_bf16"), ("amx_linear", "amx_linear_w8_f32")
    return ("w8_linear", "w8_linear_bf16"), ("w8_linear", "w8_linear_f32")
