"""Weight-only int8 on a CPU without AMX tiles: engine/kernels/native/w8_linear.c, on amx_linears.pack_w8's
copy (int8 weights, a bf16 scale per 16 values of K of each column), so the int8 engine is one scheme on
every CPU: the activations are never rounded to 8 bits (int8_linears says what that costs).

With AVX512-BF16 (AMD Zen 4 and 5, Intel Cooper Lake) it widens each weight as the AMX kernel does (q
times its scale, rounded once to bf16) and multiplies bf16 activations on its dot products. Where a step
reads more bytes than it multiplies (up to 8 or so sequences a step on a 2-core Zen 4) the copy streams
0.56 of the bf16 weights' bytes: 1.33-1.72x the bf16 engine's linears at 1-8 rows; where the products
bound it (16 rows and more there) both run at VDPBF16PS's pace (1.02-1.16x).

On AVX2 alone (AMD Zen 3, Intel Haswell to Ice Lake) it multiplies the int8 weights as integers by each
row's activations rounded to int16 (exact within 2^7 of the row's largest value, else within 2^-15 of it)
on VPMADDWD, 16 products a uop where the bf16 engine's FMAs do 8 (`integer_products`; w8_madd.h):
1.42-1.60x the bf16 engine's linears at 1-8 rows and 1.26-1.51x at 32 on a Zen 3 (Qwen3-1.7B's and
Llama-3.2-1B's shapes; bench/w8_linears.py, docs/guides/int8.md).
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
    """Whether w8_linear.c runs here (AVX512-BF16, or AVX2 with FMA; its library built)."""
    flags = native_kernels.cpu_flags()
    return ("avx512_bf16" in flags or {"avx2", "fma"} <= flags) and _fn(torch.bfloat16) is not None


native_kernels.forget_with_kernels(available.cache_clear)


def integer_products() -> bool:
    """Whether the kernel here multiplies integers (AVX2 without AVX512-BF16: each weight q * scale exactly,
    the activations as `int16_rows` rounds them) rather than the bf16 weights `amx_linears.widened_w8` gives."""
    return "avx512_bf16" not in native_kernels.cpu_flags()


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
