"""A bf16 linear on its weights where they lie (derived_weights.WeightRows: no packed copy), whichever
kernel this CPU has for it: AMX tiles (engine/kernels/amx_linears.py's `linear_bf16_rows`), else
AVX512-BF16's dot products (engine/kernels/native/bf16_rows.c: AMD Zen 4 and 5, Intel Cooper Lake).

On a CPU with AVX512-BF16 and no AMX a bf16 engine ran its linears on oneDNN's prepacked op in
Python, one layer at a time; with this kernel it holds no packed copy and runs a decode step's layers
in one C call (engine/models/native_layers.py), as on AMX. Each output is the fp32 sum of its exact
products in an order fixed by its own row and column (bf16_rows.c), so a row's bits are the same
whatever batch it is in, prefilled or decoded.

On AVX512-BF16 it runs in engines of at most AVX512_MAX_SEQS sequences (ROLLOUT_BF16_ROWS=0 keeps
oneDNN's): on a Zen 4 (2 cores, bench/RESULTS.md) its dot products ran 1.2-1.5x oneDNN's prepacked op
at 1-12 rows, where memory binds, and 1.09-1.16x at 16-32 (blocks of 8 weight rows there, each
activation vector read from L2 feeding 8 products, K whole); with the C loop it lets run, bench.engines'
32-sequence workload ran 1.05-1.08x faster than on oneDNN's path before the kernel's 1.09-1.16x
(Qwen2.5-1.5B, Qwen3-1.7B, and Llama-3.2-1B under vLLM's preloads; paired in one process), and a bf16
engine holds no packed copy of its linears.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from engine.kernels import amx_linears, derived_weights, native_kernels

ENV_SWITCH = "ROLLOUT_BF16_ROWS"
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGS = (_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR)
ROWS_MULTIPLE = 4  # weight rows of bf16_rows.c's narrow block (its wide one, 8, where every segment allows)
# The most sequences an engine may run for its bf16 linears to read their weights in place on AVX512-BF16
# (without AMX): on Zen 4 this kernel is 1.1-1.5x oneDNN's prepacked op up to 32 rows, 1.0x at 64 and 0.94-0.96x
# at 128-256 (oneDNN's activations, broadcast against a packed copy, need less of the caches than these dot
# products): bench.engines' 256-sequence workload on Llama-3.2-1B's shape ran 0.97x oneDNN's path with it and
# the C decode loop, so past 64 sequences the packed copy stays. The choice is made once per engine, so every
# row of it sums in one order (EngineConfig.batch_invariant).
AVX512_MAX_SEQS = 64


@functools.cache
def avx512_bf16() -> bool:
    """Whether bf16_rows.c runs here (AVX512-BF16, its library built)."""
    if "avx512_bf16" not in native_kernels.cpu_flags():
        return False
    if native_kernels.function("bf16_rows", "bf16_rows_linear", _ARGS, ctypes.c_int) is None:
        return False
    return True


native_kernels.forget_with_kernels(avx512_bf16.cache_clear)


def switched_on() -> bool:
    """Unless ROLLOUT_BF16_ROWS=0: bf16 linears in place on AVX512-BF16 (read at each engine's load)."""
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "off", "false", "no")


def available(max_seqs: int | None = None) -> bool:
    """Whether a bf16 linear reads its weights in place here: on AMX tiles, or on AVX512-BF16 unless
    switched off, in an engine of at most AVX512_MAX_SEQS sequences (`max_seqs`; None: any)."""
    return amx_linears.available() or (avx512_bf16() and switched_on()
                                       and (max_seqs is None or max_seqs <= AVX512_MAX_SEQS))


def rows_fit(weights) -> bool:
    """Whether `linear_rows` takes these weights here (up to three bf16 [n_i, k], rows contiguous)."""
    return amx_linears.rows_fit(weights) if amx_linears.available() else avx512_rows_fit(weights)


def avx512_rows_fit(weights) -> bool:
    """Whether bf16_rows.c takes these weights: the AMX kernel's terms with rows in fours."""
    return amx_linears.rows_fit(weights, ROWS_MULTIPLE)


def c_kernel() -> tuple[str, str]:
    """(library, symbol) of the bf16-out kernel, for the C decode loop's table (native_layers)."""
    return ("amx_linear", "amx_linear_bf16_rows") if amx_linears.available() else ("bf16_rows", "bf16_rows_linear")


def linear_rows(x: torch.Tensor, w: derived_weights.WeightRows, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [m, k] bf16 @ (w's rows).T (+ bias [n] bf16) -> [m, n] in out_dtype (bf16: the fp32 sums
    rounded once; fp32: not rounded, engine/kernels/fp32_head.py's)."""
    if amx_linears.available():
        return amx_linears.linear_bf16_rows(x, w, bias, out_dtype=out_dtype)
    return avx512_linear_rows(x, w, bias, out_dtype)


def avx512_linear_rows(x: torch.Tensor, w: derived_weights.WeightRows, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`linear_rows` on bf16_rows.c, where `avx512_bf16()` (an AMX CPU has it too: its tests call this)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=out_dtype)
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    symbol = "bf16_rows_linear_f32" if out_dtype == torch.float32 else "bf16_rows_linear"
    d = w.desc.data_ptr()
    rc = native_kernels.function("bf16_rows", symbol, _ARGS, ctypes.c_int)(
        x.data_ptr(), x.shape[0], w.k, d + 8, d + 32, len(w.weights), None if b is None else b.data_ptr(),
        out.data_ptr())
    if rc != 0:
        raise ValueError(f"{symbol}: shape {[tuple(t.shape) for t in w.weights]} not taken ({rc})")
    return out
