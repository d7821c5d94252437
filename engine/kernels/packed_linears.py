"""The model's linear layers on the CPU through oneDNN with prepacked weights, as vLLM's CPU build
runs them (issue 39 item 2).

torch's `F.linear` on the CPU is MKL's sgemm, which re-lays the weight out at every call and, on
AMD at a decode step's 32-256 rows, ran 1.3-3.8x slower than oneDNN's matmul on a weight reordered
once into its blocked layout (measured by bench.engines' micro-probe in bench/RESULTS.md). The
packed copy is a cache beside the parameter, never the parameter itself: checksums, digests, host
copies, catch-ups, LoRA and the trainer's names keep reading the plain weight.

The packed copy is a derived copy (engine/kernels/derived_weights.py): a push packs the weights it
changed from its staged tensors while the engine still serves, and its commit swaps the packed
copies in with the weights, so no forward after a commit repacks (which took ~0.5 s for SmolLM2's
538 MB, a stall every streaming client saw). Each forward still compares the weight's data pointer
and version counter with those it packed, which catches a write anywhere else (a test's `copy_`, a
reload); a commit that stages no copies (an in-place push) drops them. The pointer alone is not
enough for a push: on the CPU a commit swaps a weight onto the staging buffer it held two pushes
ago, which a bucket wrote meanwhile through a view of its own (whose version counter is not the
parameter's): the commit's copies are keyed anew at the swap.

oneDNN and torch's ideep cache a primitive per distinct row count (0.5-5 MB each), so varied
batch sizes would grow those caches toward 1-2 GB: the rows are padded up to one of `ROW_BUCKETS`
(a linear's rows are independent: padding changes no real row's sum), and more than 1024 rows run
in blocks of 1024. That bounds the caches at len(ROW_BUCKETS) primitives per weight shape (~80 MiB
on SmolLM2, bench.packed_memory) whatever the batches are, for at most a third more rows a step.

bf16 needs AVX512 (BW/VL) or AVX-NE-CONVERT in oneDNN (`supported` probes it once per dtype). A
CPU without them runs a bf16 (or fp16) model's linears on our fp32 kernel instead (`compute_dtype`; a
bf16 weight's panels kept in bf16, widened as the kernel loads them, an fp16 one's in fp32): the input
is widened, the output rounded back once. That is a bf16 GEMM's own
arithmetic (a product of two bf16 values is exact in fp32, and bf16 GEMMs accumulate in fp32), in
another summation order, and 2.8-3.7x torch's bf16 `F.linear` on an AVX2 CPU. CUDA devices keep
`F.linear`."""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import types

import torch

from engine.kernels import amx_linears, bf16_rows, derived_weights, f32_linears

log = logging.getLogger(__name__)

# The row counts a packed linear runs at: about three per octave (each at most 1/3 above the one
# before; below 8 rows, where a GEMM's time hardly moves, every power of two and its 1.5x; from 16
# to 64, a decode step's usual batch, four), so a batch of M rows costs at most ceil-to-bucket(M)
# rows of work. A primitive's memory grows with its rows (~0.5 MB at 100 rows, 1.5 MB at 1000,
# 4.5 MB at 3000 on SmolLM2's shapes), so bigger batches run in BLOCK_ROWS blocks, which costs one
# copy of the output.
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 56, 64, 80, 96, 128, 160, 192, 256,
               320, 384, 512, 640, 768, 1024)
BLOCK_ROWS = ROW_BUCKETS[-1]


@functools.cache
def supported(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build can run a prepacked linear in `dtype`."""
    try:
        w = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
        return bool((out == 8).all())
    except (RuntimeError, AttributeError) as e:  # no mkldnn in this build, or no kernel for dtype here
        log.info("prepacked linears unavailable for %s: %s", dtype, str(e).splitlines()[0])
        return False


def compute_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a model in `dtype` runs its packed linears in (None: none here, F.linear)."""
    if supported(dtype):
        return dtype
    if dtype in (torch.bfloat16, torch.float16) and supported(torch.float32):
        return torch.float32  # exact products, fp32 sums: a half-precision GEMM's arithmetic
    return None


def pack(model: torch.nn.Module, dtype: torch.dtype, max_seqs: int | None = None) -> int:
    """Route every `nn.Linear` of `model` through a weight prepacked in `dtype` (compute_dtype);
    returns how many. The weights are packed at their first forward, `repack`, or a push's staging.
    `max_seqs`: the engine's most sequences, which decides whether a bf16 weight is read in place
    (reads_in_place)."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if reads_in_place(module.weight, dtype, max_seqs):
                derived_weights.attach(module, derived_weights.rows_of, in_place=True)
            else:
                derive = functools.partial(pack_weight, dtype=dtype)
                derive.takes_parts = True  # a group's members where they lie, a retired copy's memory
                derived_weights.attach(module, derive)
            module._packed_dtype = dtype
            module._apply_derived = _packed_apply
            module.forward = types.MethodType(_packed_forward, module)
            count += 1
    return count


def reads_in_place(weight: torch.Tensor, dtype: torch.dtype, max_seqs: int | None = None) -> bool:
    """Whether a linear runs on its weight as it is (derived_weights.WeightRows: no packed copy to
    hold or to derive): a bf16 engine's on AMX tiles or AVX512-BF16 (an engine of `max_seqs` sequences:
    bf16_rows.available), an fp32 engine's on our fp32 kernel (AVX-512 or AVX2), and a bf16 model's on
    the fp32 kernel (a CPU without bf16 kernels: `dtype` fp32, its compute_dtype) where that is asked for
    (f32_linears.in_place)."""
    if dtype == torch.bfloat16 and weight.dtype == dtype:
        return bf16_rows.available(max_seqs) and bf16_rows.rows_fit([weight])
    if dtype == torch.float32 and weight.dtype in (torch.float32, torch.bfloat16):
        return f32_linears.available() and f32_linears.in_place() and f32_linears.rows_fit([weight])
    return False


def pack_weight(weight, dtype: torch.dtype, into=None):
    """A full-precision weight (or a group's members', stacked by rows) reordered into oneDNN's
    blocked layout in `dtype`, or in bf16 on a CPU with AMX into the tile kernel's
    (engine/kernels/amx_linears.py), or in fp32 on a CPU with AVX-512 or AVX2 into our kernel's
    (engine/kernels/f32_linears.py, which packs the members where they lie, into `into`'s memory when it is a
    retired copy of the same shape): the derived copy."""
    parts = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    if dtype == torch.float32 and f32_linears.available():
        spare = into if isinstance(into, f32_linears.F32Weight) else None
        # a bf16 model's weights stay bf16 in the panels (widened as the kernel loads them): half the bytes
        return f32_linears.pack([w if w.dtype == torch.bfloat16 else w.to(dtype) for w in parts], into=spare)
    weight = parts[0] if len(parts) == 1 else torch.cat(parts)
    if dtype == torch.bfloat16 and amx_linears.available():
        return amx_linears.pack(weight.to(dtype))
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype))


def _packed_modules(model: torch.nn.Module):
    return (m for m in model.modules() if hasattr(m, "_packed_dtype"))


def repack(model: torch.nn.Module) -> None:
    """Pack every changed weight now, not at the next decode step."""
    for module in _packed_modules(model):
        if module.weight.numel():
            derived_weights.current(module)


def drop(model: torch.nn.Module) -> None:
    """Free the packed copies (sleep level 2 released the weights)."""
    for module in _packed_modules(model):
        module._derived, module._derived_key = None, None


def bucket(rows: int) -> int:
    """The row count a block of `rows` (1..BLOCK_ROWS) runs at: the smallest bucket holding it."""
    return ROW_BUCKETS[bisect.bisect_left(ROW_BUCKETS, rows)]


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and self.weight.requires_grad:
        return torch.nn.functional.linear(x, self.weight, self.bias)  # oneDNN's op has no backward
    return _packed_apply(self, x, derived_weights.current(self), self.bias)


def _packed_apply(self: torch.nn.Linear, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """x @ the packed weight's transpose (+ bias): the module's own copy, or its group's
    (engine/kernels/fused_linears.py)."""
    dtype = self._packed_dtype
    rows = x.reshape(-1, x.shape[-1]).to(dtype)
    if bias is not None and bias.dtype != dtype:
        bias = bias.to(dtype)
    if isinstance(packed, derived_weights.WeightRows):  # the weights in place
        rows_linear = bf16_rows.linear_rows if dtype == torch.bfloat16 else f32_linears.linear_rows
        out = rows_linear(rows, packed, bias)
    elif isinstance(packed, amx_linears.AmxWeight):  # any row count: no primitive cache to bound
        out = amx_linears.linear_bf16(rows, packed, bias)
    elif isinstance(packed, f32_linears.F32Weight):
        out = f32_linears.linear(rows, packed, bias)
    else:
        out = blocked_linear(rows, packed, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def blocked_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`rows` @ packed.T (+ bias), run only at the bucketed row counts."""
    return blocked(rows, lambda block: _onednn_linear(block, packed, bias))


def blocked(rows: torch.Tensor, linear) -> torch.Tensor:
    """`linear(block)` over `rows`, each block padded to a bucketed row count (ROW_BUCKETS) and at
    most BLOCK_ROWS long; `linear` must treat rows independently (the padding's are dropped)."""
    m = rows.shape[0]
    if m <= BLOCK_ROWS:  # a decode step's batch: one call
        size = bucket(m) if m else 0
        return linear(rows) if size == m else linear(_padded(rows, size))[:m]
    parts = []
    for start in range(0, m, BLOCK_ROWS):
        block = rows[start:start + BLOCK_ROWS]
        n = block.shape[0]
        if bucket(n) != n:
            block = _padded(block, bucket(n))
        parts.append(linear(block)[:n])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


_pads = threading.local()
PAD_BUFFER_BYTES = 16 << 20  # the most a kept padding buffer holds


def _padded(block: torch.Tensor, rows: int) -> torch.Tensor:
    """`block` in the first rows of a `rows`-row buffer kept per (width, dtype) and thread: a fresh
    buffer a call would cost its page faults, more than the copy. The rows below are left as they
    are: each output row is a function of its own input row, and the padding's are dropped."""
    if rows * block.shape[1] * block.element_size() > PAD_BUFFER_BYTES:  # a wide layer: its GEMM dwarfs the faults
        return torch.nn.functional.pad(block, (0, 0, 0, rows - block.shape[0]))
    key = (block.shape[1], block.dtype)
    buf = getattr(_pads, "buffers", {}).get(key)
    if buf is None or buf.shape[0] < rows:
        with torch.inference_mode(False):  # a normal tensor: one made in inference mode refuses writes outside it
            buf = torch.zeros(max(rows, 64), block.shape[1], dtype=block.dtype)
        _pads.buffers = {**getattr(_pads, "buffers", {}), key: buf}
    out = buf[:rows]
    out[:block.shape[0]].copy_(block)
    return out


def _onednn_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
