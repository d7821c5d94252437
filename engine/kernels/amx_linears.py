"""Linears on Intel AMX tiles (engine/kernels/native/amx_linear.c) where the CPU has them: bf16 for the
bf16 engine (packed_linears), and for the int8 one (int8_linears) weight-only int8 (`linear_w8`:
int8 weights with a bf16 scale per 16 values of K, widened to bf16 tile by tile) or int8 x int8
(`linear_s8`), at a decode step's rows.

oneDNN runs the same tile instructions, but through torch's op it costs a primitive lookup and
its own blocking per call, and int8 two more passes (padding rows, scaling the output): on one of
SmolLM2's linears kept in cache, at 32 rows, it took 1.4x this kernel's time in bf16 and 2.5x in
int8. Streaming a whole model's weights from memory, as a decode step does, that saving is small
beside the memory's time (bench.amx_linears, idle: bf16 1.11x / 1.04x / 0.93x oneDNN's speed at
1 / 32 / 256 rows, int8 1.28x / 0.98-1.17x / 0.98-1.00x), and in the engine it gave the int8 engine
1.07-1.17x and the bf16 one 1.06x at 32 sequences but 0.96x at 256 (bench/RESULTS.md). The kernel
streams each weight once, in the order `pack` lays it out, and writes the output in the engine's
dtype.

Weight-only int8 streams 0.56 of the bf16 bytes (a byte a weight, 2 a scale per 16 of them) but widens
each weight (AVX512: to fp32, times its scale, to bf16) into a buffer the tiles then read: at 32 rows
that work is about what the tile products cost, so it gained 1.12-1.16x over bf16 in the engine (a
scale per 32 then), not the 2x its bytes would allow.

Arithmetic: int8 products sum exactly in int32 and are scaled as int8_linears' oneDNN path scales
them (the same bits, tested); bf16 products sum in fp32 in the tiles' order and round once, as a
bf16 GEMM does (oneDNN's sums in another order: the last bit may differ).

Off where the CPU lacks AMX-BF16/INT8 (AMD's, Intel's before Sapphire Rapids), where the kernel
does not build or the OS refuses the tile state, and with ROLLOUT_AMX=0 (what bench.amx_linears
compares against); the engine keeps oneDNN then."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import torch

from engine.kernels import derived_weights, native_kernels

log = logging.getLogger(__name__)

ENV_SWITCH = "ROLLOUT_AMX"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "amx_linear_s8_f32": (_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR),
    "amx_linear_s8_bf16": (_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR),
    "amx_linear_bf16": (_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR),
    "amx_linear_w8_f32": (_PTR, _I64, _I64, _PTR, _I64, _PTR),
    "amx_linear_w8_bf16": (_PTR, _I64, _I64, _PTR, _I64, _PTR),
    "amx_linear_bf16_rows": (_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR),
    "amx_linear_bf16_rows_f32": (_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR),
}
# K values per 64-byte tile row: 64 int8, 32 bf16
_TILE_K = {torch.int8: 64, torch.bfloat16: 32}


@dataclass(frozen=True)
class AmxWeight(derived_weights.PackedWeight):
    """A [n, k] weight laid out for the kernel (`pack`), in int8 or bf16."""


AmxRows = derived_weights.WeightRows  # a bf16 linear on its weights in place (`linear_bf16_rows`)
rows_of = derived_weights.rows_of


def rows_fit(weights, row_multiple: int = 16) -> bool:
    """Whether `linear_bf16_rows` takes these weights: bf16 [n_i, k] each, k % 32 == 0, every
    n_i % row_multiple == 0 (the tiles' 16; bf16_rows.c's blocks take 4), at most three, on the CPU,
    rows contiguous."""
    return (0 < len(weights) <= 3 and all(w.dtype == torch.bfloat16 and w.dim() == 2 and w.device.type == "cpu"
                                          and w.shape[1] == weights[0].shape[1] and w.shape[0] % row_multiple == 0
                                          and w.is_contiguous() for w in weights)
            and weights[0].shape[1] % 32 == 0)


def _cpu_has_amx() -> bool:
    return {"amx_tile", "amx_int8", "amx_bf16"} <= native_kernels.cpu_flags()


@functools.cache
def available() -> bool:
    """Whether the AMX kernels run here (probed once per process)."""
    if os.environ.get(ENV_SWITCH, "1").lower() in ("0", "off", "false", "no") or not _cpu_has_amx():
        return False
    init = native_kernels.function("amx_linear", "amx_init", (), ctypes.c_int)
    if init is None:
        return False
    if init() != 0:
        log.warning("the OS refused AMX's tile state (arch_prctl): linears stay on oneDNN")
        return False
    log.info("linears on AMX tiles (engine/kernels/native/amx_linear.c)")
    return True


native_kernels.forget_with_kernels(available.cache_clear)


def pack(weight: torch.Tensor) -> AmxWeight:
    """`weight` [n, k] (int8 or bf16) in the kernel's layout: [n/32][k/TK][2][16][TK/e][16][e] with
    e values of K per 4-byte pair (4 int8, 2 bf16), zero-padded to whole tiles. Pure."""
    n, k = weight.shape
    return AmxWeight(_tiles(weight, _TILE_K[weight.dtype], 4 // weight.element_size()).contiguous(), n, k)


def _tiles(weight: torch.Tensor, tk: int, e: int) -> torch.Tensor:
    """[n/32][k/tk][2][16][tk/e][16][e], zero-padded (a view of a padded copy)."""
    n, k = weight.shape
    pn, kc = -(-n // 32), -(-k // tk)
    padded = torch.zeros(pn * 32, kc * tk, dtype=weight.dtype)
    padded[:n, :k] = weight
    return padded.view(pn, 2, 16, kc, tk // e, e).permute(0, 3, 1, 4, 2, 5)


# Values of K per scale of a weight-only int8 weight (w8_chunk.h's W8_GROUP): half a chunk's 32. Per 32,
# 8.9% of SmolLM2's sampled tokens left [0.9, 1.1] (bench.fidelity's ablation), more than bf16's 7.7%.
W8_GROUP = 16
W8_CHUNK_BYTES = 64 * (32 // W8_GROUP) + 1024  # a chunk: 32 columns' scales per group, then 32 x 32 int8


def pack_w8(q: torch.Tensor, scale: torch.Tensor) -> AmxWeight:
    """A weight-only int8 weight, q [n, k] int8 with scale [n, ceil(k/W8_GROUP)] (bf16), laid out for
    `linear_w8`: per 32 columns and 32 values of K a W8_CHUNK_BYTES chunk of, per group of K, the 32
    columns' scales, then the two bf16 tiles' layout of q ([2][16][16][2]). Pure."""
    n, k = q.shape
    pn, kc, groups = -(-n // 32), -(-k // 32), 32 // W8_GROUP
    tiles = _tiles(q, 32, 2).reshape(pn, kc, 1024)
    s = torch.zeros(pn * 32, kc * groups, dtype=torch.bfloat16)  # a chunk's groups past k: zero
    s[:n, :scale.shape[1]] = scale
    s = s.view(pn, 32, kc * groups).transpose(1, 2).contiguous().view(torch.int8).view(pn, kc, 64 * groups)
    return AmxWeight(torch.cat([s, tiles], dim=2).contiguous(), n, k)


def widened_w8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bf16 weights [n, k] the weight-only kernels multiply: each q times its group's scale, rounded
    once (w8_chunk.h's widen_chunk). Pure."""
    k = q.shape[1]
    return (q.float() * scale.float().repeat_interleave(W8_GROUP, dim=1)[:, :k]).bfloat16()


def _fn(symbol: str):
    return native_kernels.function("amx_linear", symbol, _SIGNATURES[symbol], ctypes.c_int)


def _run(symbol: str, *args) -> None:
    if _fn(symbol)(*args) != 0:
        raise MemoryError(f"{symbol}: no memory for the padded activations")


def linear_bf16(x: torch.Tensor, w: AmxWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] bf16 @ w.T (+ bias [n] bf16) -> [m, n] bf16."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=torch.bfloat16)
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    _run("amx_linear_bf16", x.data_ptr(), x.shape[0], w.k, w.packed.data_ptr(), w.n,
         None if b is None else b.data_ptr(), out.data_ptr())
    return out


def linear_bf16_rows(x: torch.Tensor, w: AmxRows, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [m, k] bf16 @ (w's rows).T (+ bias [n] bf16) -> [m, n] bf16: `linear_bf16`'s bits, read from
    the weights in place. out_dtype fp32: the fp32 sums unrounded (exact products, fp32 sums: an
    fp32 GEMM of the upcast operands, engine/kernels/fp32_head.py's)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=out_dtype)
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    d = w.desc.data_ptr()
    symbol = "amx_linear_bf16_rows_f32" if out_dtype == torch.float32 else "amx_linear_bf16_rows"
    rc = _fn(symbol)(x.data_ptr(), x.shape[0], w.k, d + 8, d + 32, len(w.weights),
                     None if b is None else b.data_ptr(), out.data_ptr())
    if rc != 0:
        raise MemoryError(f"{symbol}: no memory for the tiles' activations") if rc == -1 else \
            ValueError(f"{symbol}: shape {[tuple(t.shape) for t in w.weights]} not taken")
    return out


def linear_w8(x: torch.Tensor, w: AmxWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """Weight-only int8: x [m, k] bf16 @ (w `pack_w8`ed: each weight q * scale, rounded to bf16).T,
    summed in fp32 and rounded once to out_dtype (fp32 or bf16)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=out_dtype)
    symbol = "amx_linear_w8_bf16" if out_dtype == torch.bfloat16 else "amx_linear_w8_f32"
    _run(symbol, x.data_ptr(), x.shape[0], w.k, w.packed.data_ptr(), w.n, out.data_ptr())
    return out


def linear_s8(q: torch.Tensor, row_scale: torch.Tensor, w: AmxWeight, col_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(q [m, k] int8 @ w.T) * col_scale [n], rounded to out_dtype, * row_scale [m], rounded again
    (fp32 or bf16): int8_linears' oneDNN path's bits."""
    q, row_scale = q.contiguous(), row_scale.float().contiguous()
    out = torch.empty(q.shape[0], w.n, dtype=out_dtype)
    symbol = "amx_linear_s8_bf16" if out_dtype == torch.bfloat16 else "amx_linear_s8_f32"
    _run(symbol, q.data_ptr(), q.shape[0], w.k, w.packed.data_ptr(), w.n, col_scale.data_ptr(),
         row_scale.data_ptr(), out.data_ptr())
    return out
