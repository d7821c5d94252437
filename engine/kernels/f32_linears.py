"""fp32 linears through engine/kernels/native/f32_linear.c where the CPU has AVX-512 or AVX2 with FMA: each
weight packed once into panels of 32 output columns ([n/32][k][32], a derived copy like oneDNN's), 12 rows x 32
columns of fp32 accumulators in registers (6 rows x 16 columns, each half of a panel in turn, on AVX2's 16
registers), K in chunks that stay in L2, the weights prefetched.

On an Intel Xeon (AVX-512, 2 cores), swept over SmolLM2's linears as a decode step streams them, it
ran 1.20-1.31x / 1.15x / 1.01-1.05x oneDNN's prepacked matmul at 1 / 32 / 256 rows
(bench.f32_linears); oneDNN's op also costs a primitive lookup per call, and MKL's packed GEMM
(faster still on some shapes) pads each weight's copy to at least 8 MB (2 GB for SmolLM2's
538 MB). Being ours, the decode step's C loop (engine/models/native_layers.py) can call it too, which it
cannot do with torch's ops. Activation rows whose length is a multiple of 4 KB (K = 1024, 2048, 6144,
8192: Llama's and Qwen3's linears) are copied a cache line apart before a call of several rows: a
block's 12 rows otherwise share one L1 set (on a Zen 4 at 32 rows, 1.04-1.35x per linear; the
engine's fp32 decode 1.09-1.12x, bench/RESULTS.md).

On an AMD EPYC with AVX2 only (Zen 3, 2 cores) it ran 1.05 / 1.36 / 1.43 / 1.35x oneDNN's prepacked
matmul at 1 / 8 / 16 / 32 rows on Qwen2.5-1.5B's linears (99% of the fp32 matmul probe at 32 rows, 98% of
the read probe at 1) once each chunk of a panel is prefetched while the one before is multiplied
(f32_panels.h; 1.00-1.08x at 8-32 rows before). A bf16 model's linears there run on it too
(packed_linears.compute_dtype), on panels kept in bf16 and widened as they are loaded: the fp32 panels'
values and bits in half their bytes, 2.09 / 1.37 / 1.27 / 1.04x the fp32 copy's speed at 1 / 8 / 16 / 32
rows (0.96x at 256, where the products bound a call and the widening costs 4%). Each output row's sums are
the same whatever the other rows are, which oneDNN's GEMM does not promise: a request's bits in any batch.

Arithmetic: each output is the fp32 sum of its k products in order of k (one FMA a product), then
its bias: a plain fp32 GEMM's error bound (tested); the same bits on AVX-512 and AVX2. With
ROLLOUT_F32_KERNEL=0 (or neither ISA), oneDNN stays."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import torch

from engine.kernels import derived_weights, native_kernels

log = logging.getLogger(__name__)

ENV_SWITCH = "ROLLOUT_F32_KERNEL"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
PANEL = 32  # output columns a panel


@dataclass(frozen=True)
class F32Weight(derived_weights.PackedWeight):
    """A [n, k] weight in panels of PANEL columns for the fp32 kernel: [ceil(n/32), k, 32], zero-padded,
    fp32, or bf16 in f32_pack_rows_bf16's order within each row (a bf16 model's, multiplied in fp32)."""


def _fn(dtype: torch.dtype = torch.float32):
    """The kernel over fp32 panels, or over bf16 ones (f32_linear_bf16_panels)."""
    symbol = "f32_linear_bf16_panels" if dtype == torch.bfloat16 else "f32_linear"
    return native_kernels.function("f32_linear", symbol, (_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR), ctypes.c_int)


@functools.cache
def available() -> bool:
    """Whether the kernel serves fp32 linears here (probed once per process)."""
    flags = native_kernels.cpu_flags()
    if os.environ.get(ENV_SWITCH, "1").lower() in ("0", "off", "false", "no") or not (
            "avx512f" in flags or {"avx2", "fma"} <= flags):
        return False
    if _fn() is None:
        return False
    log.info("fp32 linears on engine/kernels/native/f32_linear.c")
    return True


native_kernels.forget_with_kernels(available.cache_clear)



def _pack_fn(dtype: torch.dtype = torch.float32):
    symbol = "f32_pack_rows_bf16" if dtype == torch.bfloat16 else "f32_pack_rows"
    return native_kernels.function("f32_pack", symbol, (_PTR, _PTR, _I64, _I64, _PTR), None)


def pack(weights, into: F32Weight | None = None) -> F32Weight:
    """`weights` [n, k] (or up to three [n_i, k], stacked by rows as a group's copy is: no stacked
    copy made) in panels: in one pass of engine/kernels/native/f32_pack.c where it builds, else
    torch's (the same bytes). bf16 weights stay bf16 in panels of their own order (f32_pack_rows_bf16:
    half the bytes of fp32 panels, the same values and bits; a bf16 model's copy on a CPU without bf16
    kernels). `into`: a copy of the same shape and dtype whose memory takes the panels (one a commit
    retired: fresh pages fault in at ~1 GB/s here, twice the pack's own time)."""
    parts = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    n, k = sum(w.shape[0] for w in parts), parts[0].shape[1]
    dtype = torch.bfloat16 if all(w.dtype == torch.bfloat16 for w in parts) else torch.float32
    native = _pack_fn(dtype) if all(w.device.type == "cpu" for w in parts) and len(parts) <= 3 else None
    if native is None:
        return pack_torch(parts[0] if len(parts) == 1 else torch.cat(parts))
    parts = [w.to(dtype).contiguous() for w in parts]
    fits = into is not None and (into.n, into.k) == (n, k) and into.packed.dtype == dtype
    out = into.packed if fits else torch.empty(-(-n // PANEL), k, PANEL, dtype=dtype)
    segs = (ctypes.c_void_p * 3)(*[w.data_ptr() for w in parts])
    rows = (ctypes.c_int64 * 3)(*[w.shape[0] for w in parts])
    native(segs, rows, len(parts), k, out.data_ptr())
    return into if fits else F32Weight(out, n, k)


def pack_torch(weight: torch.Tensor) -> F32Weight:
    """`pack` in torch's ops (the reference the one-pass pack is held to)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return F32Weight(padded.view(panels, PANEL, k).transpose(1, 2).contiguous(), n, k)


IN_PLACE_SWITCH = "ROLLOUT_F32_IN_PLACE"


def in_place() -> bool:
    """Whether the fp32 kernel's linears read their weights in place (`linear_rows`: no panels to
    hold or to derive, the same bits) rather than a packed copy: ROLLOUT_F32_IN_PLACE=1, for a
    sidecar short of memory (the panels are the model's bytes again; a push derives nothing). An fp32
    model's, and a bf16 model's on a CPU without bf16 kernels (AVX2: its bf16 weights widened as they
    are read, f32_linear_rows_bf16). Off by default: on SmolLM2's shapes a decode step's few rows read
    fp32 weights slower that way (a rollout workload ran 0.76x the packed copy's tokens/s), though at
    1.7B's shapes and 32 rows it was faster; a bf16 Qwen3-1.7B shape on a Zen 3 ran 0.77-0.83x the bf16
    panels' tokens/s at 32 sequences, its sidecar holding 2.51x the model instead of 4.51x, and since the
    panels' chunks are prefetched ahead of their products its linears run 0.57-0.83x theirs at 1-32 rows
    (bench/RESULTS.md)."""
    return os.environ.get(IN_PLACE_SWITCH, "0").lower() in ("1", "on", "true", "yes")


def rows_fit(weights) -> bool:
    """Whether `linear_rows` takes these weights: fp32 [n_i, k] each (or all bf16: a bf16 model's), rows
    contiguous, at most three, one k, on the CPU."""
    return (0 < len(weights) <= 3 and weights[0].dtype in (torch.float32, torch.bfloat16)
            and all(w.dtype == weights[0].dtype and w.dim() == 2 and w.device.type == "cpu"
                    and w.shape[1] == weights[0].shape[1] and w.is_contiguous() for w in weights))


def _rows_fn(dtype: torch.dtype = torch.float32):
    """The kernel over fp32 weight rows, or over bf16 ones (f32_linear_rows_bf16: the bf16 panels' bits)."""
    symbol = "f32_linear_rows_bf16" if dtype == torch.bfloat16 else "f32_linear_rows"
    return native_kernels.function("f32_linear", symbol, (_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR),
                                   ctypes.c_int)


def linear_rows(x: torch.Tensor, w: derived_weights.WeightRows, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] fp32 @ (w's rows).T (+ bias [n]) -> [m, n] fp32: `linear`'s bits (fp32 rows; bf16 rows: the
    bf16 panels'), read from the weights where they lie."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    d = w.desc.data_ptr()
    if _rows_fn(w.dtype)(x.data_ptr(), x.shape[0], w.k, d + 8, d + 32, len(w.weights),
                         None if b is None else b.data_ptr(), out.data_ptr()) != 0:
        raise MemoryError("f32_linear_rows: no memory for its partial sums")
    return out


def linear(x: torch.Tensor, w: F32Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] fp32 @ w.T (+ bias [n]) -> [m, n] fp32 (w's panels fp32 or bf16: the same arithmetic)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    if _fn(w.packed.dtype)(x.data_ptr(), x.shape[0], w.k, w.packed.data_ptr(), w.n, None if b is None else b.data_ptr(),
                           out.data_ptr()) != 0:
        raise MemoryError("f32_linear: no memory for its partial sums")
    return out
