"""The model's linear layers on the CPU in int8, derived from the full-precision weights a trainer
pushes (issue 49 item 4; `EngineConfig.quantization="int8"`).

The full-precision parameter stays the truth: checksums, digests, deltas, host copies, healing,
peer catch-up and LoRA read it. The int8 copy is a cache beside it (the module's derived copy,
engine/kernels/derived_weights.py), made by the pure `derive(weight)`. Two schemes, by the kernel
this CPU runs (`kernel()`):

- **Weight-only** (first choice, where the CPU has AMX tiles: engine/kernels/amx_linears.py's `linear_w8`,
  else engine/kernels/w8_linears.py's, on AVX512-VNNI or AVX2 with FMA): a bf16 scale per 16
  values of K of each output channel (amx_linears.W8_GROUP); on AMX the int8 weights widened to bf16 (q
  times its scale, rounded once) inside the kernel and the activations kept in bf16, elsewhere the int8
  weights multiplied as integers by each row's activations rounded to int16. On SmolLM2, 7.1% of sampled
  tokens leave [0.9, 1.1] in trainer/engine probability ratio (the bf16 engine: 7.7%; at another seed
  7.9% and 8.5%; per 32 values of K it was 9.4-9.9%; the integers 6.74-7.07%: bench/fidelity.py), at
  1.12-1.16x the bf16 engine's tokens/s at 32 sequences on AMX and 1.0x at 256 (groups of 32); as
  integers 1.30-1.31x at 8 sequences and 1.05-1.07x at 32 on a Zen 4, 1.20-1.60x at 8-32 on a Zen 3
  (bench/RESULTS.md).
- **Per token** (W8A8; a CPU with none of them, or ROLLOUT_INT8_ACTIVATIONS=int8): symmetric per-channel
  weight scales (a row's largest |w| maps to 127), activations quantized per token (per row) at each
  forward, so a row's output depends on that row alone (a per-tensor activation scale, what oneDNN's
  op and fbgemm's dynamic linear are made for, would let one sequence's outlier coarsen every
  other's). Faster on AMX (1.21-1.25x bf16 at 32 sequences) but it moves the policy: 58.6% of
  SmolLM2's sampled tokens leave [0.9, 1.1] (weights alone per channel: 21%; per group of 32: 9.4%, of 16: 7.1%),
  and GRPO with it and TIS learned at one seed of three where the fp32 engine learned at all three.

The per-token kernels, measured by bench/int8_linears.py (bench/RESULTS.md): oneDNN's int8 linear
(`onednn.qlinear_pointwise` on a `qlinear_prepack`ed weight, activation scale 1, the per-token
scales multiplied into its output) ran SmolLM2's linears 1.4-1.7x faster than `torch._int_mm` with
the same quantization; torch's weight-only op (`_weight_int8pack_mm`) wins at 1 row but falls to
0.07-0.38x of packed bf16 from 8 rows, which is why weight-only int8 runs on our own kernels (AMX's,
and the integer one on AVX512-VNNI or AVX2).
oneDNN's int8 on an AVX2-only CPU (no VNNI) lost accuracy (its u8 x s8 pairs saturate int16: 10%
error where the exact int32 sum gives 1%), so `kernel()` probes once that a kernel gives the exact
integer product and falls back to `torch._int_mm`, then to 7-bit weights (on AVX2, with oneDNN's ISA
capped to it, `_int_mm` ran 1.3-3.4x faster than oneDNN's int8), then to none: the engine refuses
int8 there. On AMX, `amx` is the per-token scheme on the tiles: the oneDNN path's exact bits, faster.

The copy is a derived copy (engine/kernels/derived_weights.py), as the prepacked linears' are: a push
derives it from its staged weights while the engine serves and its commit swaps it in with them;
each forward compares the weight's data pointer, version and shape with those it derived from
(a write anywhere else derives it again)."""

from __future__ import annotations

import functools
import logging
import os
import types
from dataclasses import dataclass

import torch

from engine.kernels import (amx_linears, derived_weights, native_glue, native_quantize, packed_linears,
                            w8_linears)

log = logging.getLogger(__name__)

# (kernel, largest |q| of a weight), by preference: bench/int8_linears.py measured the kernels in
# this order. 7-bit weights (63) are the fallback of a CPU without VNNI: its int8 dot product sums
# u8 x s8 pairs in int16, which 255 * 127 * 2 overflows and 255 * 63 * 2 does not (fbgemm's
# reduce_range, on the other side of the product).
# "amx_w8": engine/kernels/amx_linears.py's weight-only kernel where the CPU has AMX (int8 weights widened
# to bf16 in the tiles, activations in bf16: no per-token rounding of the inputs, the policy moves
# far less); "w8": the same int8 weights and scales elsewhere, as integers times the activations rounded
# to int16 per row (AVX512-VNNI or AVX2: engine/kernels/w8_linears.py);
# "amx": its int8 x int8 kernel (the same bits as "onednn", faster).
KERNELS = (("amx_w8", 127), ("w8", 127), ("amx", 127), ("onednn", 127), ("int_mm", 127), ("int_mm", 63),
           ("onednn", 63))
WEIGHT_ONLY = ("amx_w8", "w8")  # kernels that keep the activations in bf16 (or int16 of each row's largest)
ENV_ACTIVATIONS = "ROLLOUT_INT8_ACTIVATIONS"

# NOTE: the lm_head stays in full precision (on packed_linears' copy): its logits are the policy's
# log-probabilities one softmax away, and quantizing it too moved the share of SmolLM2's sampled
# tokens whose trainer/engine probability ratio leaves [0.9, 1.1] from 60.1% to 64.5%
# (bench/fidelity.py, engines "int8" and "int8+lm_head"; bench/RESULTS.md).
KEEP_FULL_PRECISION = ("lm_head",)


@dataclass(frozen=True)
class Int8Weight:
    """An int8 copy of a [N, K] weight: w ~ q * scale[:, None]. `packed`: q in `kernel`'s layout
    (oneDNN's prepacked tensor, the AMX kernel's AmxWeight, or q itself for _int_mm)."""

    packed: torch.Tensor | amx_linears.AmxWeight
    scale: torch.Tensor  # [N] fp32; weight-only: [N, ceil(K/W8_GROUP)] bf16, one per group of K
    kernel: str
    shape: tuple[int, int]
    qmax: int = 127

    @property
    def nbytes(self) -> int:
        return copy_bytes(self.shape, self.kernel)


def copy_bytes(shape: tuple[int, int], kernel_name: str) -> int:
    """An int8 copy's memory: a byte a weight, and a 4-byte scale a row (a 2-byte one a group of
    amx_linears.W8_GROUP values of a row for the weight-only kernel)."""
    n, k = shape
    return n * k + (2 * n * -(-k // amx_linears.W8_GROUP) if kernel_name in WEIGHT_ONLY else 4 * n)


def quantize_weight(w: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale fp32 [N]): symmetric per output channel, |q| <= qmax."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / qmax
    return torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8), scale


def quantize_groups(w: torch.Tensor, group: int = amx_linears.W8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale bf16 [N, ceil(K/group)]): symmetric per `group` values of K of each
    output channel, the scale rounded to bf16 first (what the kernel reads) and |q| <= 127."""
    w = w.detach().float()
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % group)).view(n, -1, group)
    scale = (padded.abs().amax(-1) / 127).to(torch.bfloat16).clamp_(min=torch.finfo(torch.bfloat16).tiny)
    q = torch.round(padded / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, -1)[:, :k].contiguous(), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [M, K], scale fp32 [M, 1]): symmetric per row (token); |x| / scale <= 127, so the
    rounding needs no clamp. In the C kernel of engine/kernels/native_quantize.py where it runs (same bits)."""
    native = native_quantize.quantize_rows(x)
    if native is not None:
        return native
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny).div_(127)
    return torch.div(x, scale).round_().to(torch.int8), scale


def derive(weight: torch.Tensor, how: tuple[str, int] | None = None) -> Int8Weight:
    """The int8 copy of `weight` ([N, K], any float dtype) for `how` = (kernel, qmax) (default:
    `kernel()`). Pure: reads the weight, writes nothing."""
    name, qmax = how or kernel()
    if name not in WEIGHT_ONLY:
        return _packed(*quantize_weight(weight, qmax), name, qmax)
    _check_runs(name)  # before any work: the copy would be of no use here
    native = native_quantize.quantize_groups_packed(weight)  # the same bits in one pass
    if native is None:
        return _packed(*quantize_groups(weight), name, qmax)
    n, k = weight.shape
    return Int8Weight(amx_linears.AmxWeight(native[0], n, k), native[1], name, (n, k), qmax)


def _packed(q: torch.Tensor, scale: torch.Tensor, name: str, qmax: int) -> Int8Weight:
    if name in ("amx", *WEIGHT_ONLY):
        _check_runs(name)
        packed = amx_linears.pack_w8(q, scale) if name in WEIGHT_ONLY else amx_linears.pack(q)
    else:
        packed = torch.ops.onednn.qlinear_prepack(q, None) if name == "onednn" else q
    return Int8Weight(packed, scale, name, tuple(q.shape), qmax)


def _check_runs(name: str) -> None:
    """Raises RuntimeError where kernel `name` (the AMX ones or w8_linears') does not run here."""
    if name.startswith("amx") and not amx_linears.available():
        raise RuntimeError("no AMX tiles here (or ROLLOUT_AMX=0)")
    if name == "w8" and not w8_linears.available():
        raise RuntimeError("no AVX2 with FMA here (or no kernel build)")


def _linear_w8(name: str):
    """The weight-only kernel `name`'s linear: (x bf16, packed, out_dtype) -> out."""
    return amx_linears.linear_w8 if name == "amx_w8" else w8_linears.linear_w8


@functools.cache
def _zero_points(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


def matmul(q: torch.Tensor, w: Int8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """q [M, K] int8 @ w.T, times w's per-channel scales, in `out_dtype` (the per-row scales not
    applied)."""
    if w.kernel in WEIGHT_ONLY:  # an int8 value is exact in bf16 (and so q * a scale of 1)
        return _linear_w8(w.kernel)(q.to(torch.bfloat16), w.packed, out_dtype)
    if w.kernel == "amx":
        return amx_linears.linear_s8(q, torch.ones(q.shape[0]), w.packed, w.scale, out_dtype)
    if w.kernel == "onednn":
        if q.shape[0] == 1:  # oneDNN's one-row int8 path ran 2.8 ms on a 192x576 weight, 2 rows 0.03 ms
            return matmul(q.expand(2, -1).contiguous(), w, out_dtype)[:1]
        return torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, w.packed, w.scale, _zero_points(w.shape[0]), None,
                                                  1.0, 0, out_dtype, "none", [], "")
    return torch._int_mm(q, w.packed.t()).to(out_dtype).mul_(w.scale)


def kernel() -> tuple[str, int] | None:
    """The first of KERNELS that runs here and gives the exact integer product (probed once);
    ROLLOUT_INT8_ACTIVATIONS=int8 passes over the weight-only kernels (what bench.fidelity and
    bench.engines compare them with)."""
    weight_only = os.environ.get(ENV_ACTIVATIONS, "bf16").lower() != "int8"
    return _first_exact(tuple(k for k in KERNELS if weight_only or k[0] not in WEIGHT_ONLY))


@functools.cache
def _first_exact(kernels: tuple) -> tuple[str, int] | None:
    for name, qmax in kernels:
        try:
            error = _probe_error(name, qmax)
        except (RuntimeError, AttributeError) as e:  # not in this build, or no kernel for this CPU
            log.info("int8 kernel %s unavailable: %s", name, str(e).splitlines()[0])
            continue
        if error == 0:
            log.info("int8 linears: %s, weights in [-%d, %d]", name, qmax, qmax)
            return name, qmax
        log.info("int8 kernel %s with weights up to %d is inexact on this CPU (error %.3g): not used",
                 name, qmax, error)
    return None


def _probe_error(name: str, qmax: int) -> float:
    """How far `name`'s product of full-scale int8 values (what saturates a kernel that sums int8
    pairs in 16 bits) and random ones is from the exact one (0: exact; sums below 2^24 are exact
    in fp32)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (8, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-qmax, qmax + 1, (16, 64), generator=g, dtype=torch.int8)
    q[:, :32], w[:, :32] = 127, qmax
    q[1, :32], w[1, :32] = -127, -qmax
    want = q.double() @ w.double().t()
    groups = 64 // amx_linears.W8_GROUP
    ones = torch.ones(16, groups, dtype=torch.bfloat16) if name in WEIGHT_ONLY else torch.ones(16)
    got = matmul(q, _packed(w, ones, name, qmax), torch.float32)
    return (got.double() - want).abs().max().item()


def install(model: torch.nn.Module, keep: tuple[str, ...] | None = None) -> int:
    """Route every `nn.Linear` of `model` (but those named in `keep`, default KEEP_FULL_PRECISION)
    through an int8 copy of its weight; returns how many. Raises RuntimeError where no int8 kernel
    runs exactly."""
    keep = KEEP_FULL_PRECISION if keep is None else keep
    how = kernel()
    if how is None:
        raise RuntimeError(f"no int8 linear kernel runs exactly on this CPU (tried {KERNELS})")
    if how[0] not in WEIGHT_ONLY:
        log.warning("int8 linears here quantize activations per token (kernel %s): on SmolLM2 that moved 59%% of "
                    "sampled tokens' probabilities by over 10%% (weight-only int8: 9%%; "
                    "bench.fidelity)", how[0])
    elif how[0] == "w8":
        log.info("weight-only int8 without AMX multiplies integers (VPDPWSSD or VPMADDWD, the activations in "
                 "int16): 1.1-1.6x the bf16 engine's tokens/s at 8-32 sequences (bench/RESULTS.md), in 1.1 bytes "
                 "a weight beside bf16's 2")
    count = 0
    native_glue.glue_in_c(model)  # fp32 glue in C, as the C decode loop runs it
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in keep:
            # in place of a prepacked copy, if it had one; the kernel is fixed for the model's life
            derived_weights.attach(module, functools.partial(derive, how=how))
            module._eight_bit_bytes = copy_bytes(tuple(module.weight.shape), how[0])  # quantized_bytes' count
            module._apply_derived = _int8_apply
            module.forward = types.MethodType(_int8_forward, module)
            count += 1
    return count


def _int8_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and self.weight.requires_grad:
        return torch.nn.functional.linear(x, self.weight, self.bias)  # the int8 ops have no backward
    return _int8_apply(self, x, derived_weights.current(self), self.bias)


def _int8_apply(self: torch.nn.Linear, x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x through the int8 copy `w`: the module's own, or its group's (engine/kernels/fused_linears.py)."""
    out_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    if w.kernel in WEIGHT_ONLY:
        out = _linear_w8(w.kernel)(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), w.packed, out_dtype)
        return _finish(out, x, bias)
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    if w.kernel == "amx":  # both scales in the kernel, any row count: nothing to pad
        out = amx_linears.linear_s8(q, scale, w.packed, w.scale, out_dtype)
    else:
        out = packed_linears.blocked(q, lambda block: matmul(block, w, out_dtype))
        if not native_quantize.scale_rows_(out, scale):
            out.mul_(scale)
    return _finish(out, x, bias)


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
