"""A sparse MLP's maths as pure functions: the router's top-k choice and the experts' weighted sum.

`route` is HF's TopKRouter (softmax in fp32, top-k, optionally renormalised). `run` groups the
step's (token, slot) picks by expert and runs each active expert once over its tokens (one grouped
GEMM call: one pass over each active expert's weights a step, however many tokens chose it, no
Python loop over experts), in the operations and order of transformers' default experts forward,
so its output has HF's bits: the reference. `block_native` is both in one C call a layer on the
weights in place (engine/kernels/native/moe_experts.c), or on AVX2 on a copy of them as panels
(`attach_panels`), what the engine runs where its kernels do.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels import amx_linears, bf16_rows, derived_weights, f32_linears, native_kernels

ENV_SWITCH = "ROLLOUT_NATIVE_EXPERTS"  # 0: torch's grouped GEMM (`run`) always
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


def route(logits: torch.Tensor, top_k: int, norm_topk: bool, scores_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from router logits [T, E]: softmax in fp32, the top k,
    renormalised to sum to one when `norm_topk`; the weights back in the logits' dtype unless
    `scores_fp32` (Mixtral's router keeps them in fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if scores_fp32 else weights.to(logits.dtype)), ids


def groups(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pick order, the end of each expert's picks in it): the step's picks (token-major, pick
    i * k + j is token i's slot j) sorted by expert, stably, as HF sorts them."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.cumsum(torch.bincount(flat, minlength=experts), 0, dtype=torch.int32)


def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's k picks of weight * down_e(act(gate_e(x)) * up_e(x)): x [T, H], ids and
    weights [T, k], gate_up [E, 2I, H] (gate rows first), down [E, H, I]. HF's grouped experts
    (transformers' `grouped_mm` experts, its default) op for op: both GEMMs as one grouped GEMM
    over the picks sorted by expert, the weights applied per pick, each token's k picks summed at
    once in the picks' dtype (fp32 where the weights are) and rounded to x's dtype once."""
    t, k = ids.shape
    order, ends = groups(ids, gate_up.shape[0])
    gate, up = grouped_linear(x[order // k], gate_up, ends).chunk(2, dim=-1)
    picks = grouped_linear(act(gate) * up, down, ends) * weights.reshape(-1)[order, None]
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return picks[back].view(t, k, -1).sum(dim=1).to(x.dtype)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ends[e-1]:ends[e] of x times w[e].T: torch's grouped GEMM, or, on shapes it refuses (rows
    not a multiple of 16 bytes), one GEMM an expert (the same bits: both run each group's mm)."""
    if all(n * x.element_size() % 16 == 0 for n in w.shape[1:]) and x.data_ptr() % 16 == 0 == w.data_ptr() % 16:
        return F.grouped_mm(x, w.transpose(-2, -1), offs=ends)
    out, start = x.new_empty(x.shape[0], w.shape[1]), 0
    for e, end in enumerate(ends.tolist()):
        torch.mm(x[start:end], w[e].t(), out=out[start:end])
        start = end
    return out


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [T, H] . weight [E, H]^T in C (engine/kernels/native/moe_experts.c's router_logits_*: fp32 sums,
    rounded once), where the C block runs for this dtype; None elsewhere (then F.linear). Both of
    the engine's forwards route through it, so that the C decode loop's routing is the Python
    forward's to the bit."""
    dtype = x.dtype
    loaded = _native(dtype) if dtype in _KERNELS else None
    if (loaded is None or weight.dtype != dtype or torch.is_grad_enabled() or x.dim() != 2
            or not (x.is_contiguous() and weight.is_contiguous()) or x.device.type != "cpu"):
        return None
    out = x.new_empty(x.shape[0], weight.shape[0])
    loaded[2](x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], out.data_ptr())
    return out


def loop_kernels(dtype: torch.dtype, invariant: bool = True, on_panels: bool = False) -> tuple[int, int, int] | None:
    """(moe_block_*, its kernel table, router_logits_*) as addresses, for the C decode loop
    (engine/models/native_layers.py), or None where the C block does not run for `dtype` (or, `on_panels`,
    not over the experts' panels)."""
    loaded = _native(dtype) if dtype in _KERNELS else None
    if loaded is None or (invariant, on_panels) not in loaded[1]:
        return None
    entry, tables, router = loaded
    return ctypes.cast(entry, _PTR).value, tables[invariant, on_panels].data_ptr(), ctypes.cast(router, _PTR).value


def fits(h: int, i: int, dtype: torch.dtype) -> bool:
    """Whether the C block's kernels take a hidden size `h` and an expert width `i` in `dtype`."""
    return dtype != torch.bfloat16 or (h % 32 == 0 and i % 32 == 0)


# fp32 experts on their weights in place: the dot products up to this many rows an expert, the rows kernel
# above (moe_experts.c groups_f32); a batch-invariant engine takes the dot products at every size (no limit),
# so that a token's sums do not depend on how many other tokens chose its experts in the step. bf16's kernels
# (AMX tiles, or AVX512-BF16's dot products) and the panels (`panels`, AVX2's both dtypes) sum each output in
# one order at any row count: invariant either way.
DOT_MAX_ROWS = 16
NO_LIMIT = 2**62
_KERNELS = {torch.bfloat16: (("amx_linear", "amx_linear_bf16_groups"), ("layer_glue", "silu_mul_bf16")),
            torch.float32: (("f32_linear", "f32_linear_rows"), ("layer_glue", "silu_mul_f32"))}
# Without AMX tiles, bf16 experts on AVX512-BF16 (AMD Zen 4 and 5): bf16_rows.c's groups, the same terms;
# without either (AVX2: AMD Zen 3), over panels (`panels`), or moe_experts.c's dot products on the bf16 weights
# widened as loaded where the panels are switched off
_AVX512_BF16_GROUPS = ("bf16_rows", "bf16_rows_groups")
_BF16_DOT_GROUPS = ("moe_experts", "bf16_dot_groups")


def _kernels(dtype: torch.dtype) -> tuple | None:
    """((library, symbol) of the GEMM, of the silu) for `dtype` on this CPU, or None where none runs."""
    if dtype == torch.bfloat16:
        if amx_linears.available():
            return _KERNELS[dtype]
        if bf16_rows.avx512_bf16():
            return _AVX512_BF16_GROUPS, _KERNELS[dtype][1]
        return (_BF16_DOT_GROUPS, _KERNELS[dtype][1]) if f32_linears.available() else None
    return _KERNELS[dtype] if f32_linears.available() else None


_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_loaded: dict = {}

# On AVX2 both dtypes' experts run over a copy of their weights as panels (f32_linear.c's
# f32_panel_groups*: a dense linear's kernel, the weights streamed while the products run): on a Zen 3 the
# bf16 experts' GEMMs 1.3-1.7x the dot products in place at 4-32 rows an expert (bench.expert_gemms), a
# qwen3-moe-2core engine 1.14-1.19x the tokens/s at 32 sequences and 1.16x at 256, fp32 1.03-1.08x and 1.26x
# (bench/RESULTS.md), for the experts' bytes again in memory, as the dense linears' panels there.
# ROLLOUT_EXPERT_PANELS=1 takes them on any CPU f32_linear.c runs on, 0 on none; ROLLOUT_F32_IN_PLACE=1
# (a sidecar short of memory) keeps the experts in place.
PANELS_SWITCH = "ROLLOUT_EXPERT_PANELS"
_PANEL_GROUPS = {torch.bfloat16: "f32_panel_groups_bf16", torch.float32: "f32_panel_groups"}


def panels(dtype: torch.dtype) -> bool:
    """Whether experts in `dtype` run over a copy of their weights as panels here (see PANELS_SWITCH)."""
    switch = os.environ.get(PANELS_SWITCH, "").lower()
    if switch in ("0", "off", "false", "no") or dtype not in _PANEL_GROUPS or f32_linears.in_place():
        return False
    if not f32_linears.available() or _native(dtype) is None:
        return False
    return switch in ("1", "on", "true", "yes") or "avx512f" not in native_kernels.cpu_flags()


def _native(dtype: torch.dtype):
    """(entry, kernel table, router) of engine/kernels/native/moe_experts.c for `dtype`, or None where its
    kernels do not run here (no AVX-512 or AVX2, no compiler, switched off)."""
    if dtype not in _loaded:
        kernels = _kernels(dtype)
        ok = kernels is not None and os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "off", "false", "no")
        libs = [native_kernels.library(lib) for lib, _ in kernels] if ok else []
        entry = native_kernels.function("moe_experts", f"moe_block_{_SUFFIX[dtype]}",
                                        (_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int, _PTR,
                                         _PTR, _I64, *(_PTR,) * 10), ctypes.c_int) if ok else None
        if entry is None or not all(libs):
            _loaded[dtype] = None
        else:
            fns = [ctypes.cast(getattr(lib, sym), _PTR).value for lib, (_, sym) in zip(libs, kernels)]
            grouped = native_kernels.library("f32_linear")
            grouped = ctypes.cast(getattr(grouped, _PANEL_GROUPS[dtype]), _PTR).value if grouped else None
            tables = {}
            for invariant in (False, True):
                row = fns + [NO_LIMIT if invariant else DOT_MAX_ROWS, 0]  # [GEMM, silu, dots' limit, fp32 panels]
                tables[invariant, False] = torch.tensor(row, dtype=torch.int64)
                if grouped:  # the experts' panels (panels()): bf16's GEMM, fp32's fourth entry
                    on_panels = [grouped, *row[1:3], 0] if dtype == torch.bfloat16 else [*row[:3], grouped]
                    tables[invariant, True] = torch.tensor(on_panels, dtype=torch.int64)
            router = native_kernels.function("moe_experts", f"router_logits_{_SUFFIX[dtype]}",
                                             (_PTR, _I64, _I64, _PTR, _I64, _PTR))
            _loaded[dtype] = (entry, tables, router)
    return _loaded[dtype]


def reset() -> None:
    _loaded.clear()


native_kernels.forget_with_kernels(reset)


def _fits(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the C block takes these: contiguous on the CPU, one dtype, and for the bf16 rows
    kernel rows in sixteens and its k in thirty-twos."""
    if not all(t.is_contiguous() and t.device.type == "cpu" and t.dtype == x.dtype for t in (x, logits, gate_up, down)):
        return False
    return fits(x.shape[1], down.shape[2], x.dtype)


def block_native(x: torch.Tensor, logits: torch.Tensor, top_k: int, norm_topk: bool, scores_fp32: bool,
                 gate_up: torch.Tensor, down: torch.Tensor, invariant: bool = True,
                 on_panels: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(`run` of `route`'s choice, the expert ids [T, k]) in one C call on the weights in place, or on
    `on_panels` (their copies: `served_panels`) where given (engine/kernels/native/moe_experts.c; silu
    experts), or None where it does not run (another dtype, shapes its kernels refuse, gradients). Its
    softmax, and each GEMM's order of sums, are C's: within their roundings of torch's. `invariant`: each
    token's sums in one order whatever shares the call (DOT_MAX_ROWS; the panels' always)."""
    dtype = x.dtype
    if dtype not in _KERNELS or torch.is_grad_enabled() or not _fits(x, logits, gate_up, down):
        return None
    loaded = _native(dtype)
    if loaded is None or (invariant, on_panels is not None) not in loaded[1]:
        return None
    entry, tables, _ = loaded
    table = tables[invariant, on_panels is not None]
    (t, h), e, i = x.shape, gate_up.shape[0], down.shape[2]
    if on_panels is not None:
        gate_up, down = on_panels
    s = t * top_k
    scratch = torch.empty(s * (2 * h + 3 * i), dtype=dtype)
    xg, gu, act, dn = scratch.split([s * h, s * 2 * i, s * i, s * h])
    index = torch.empty(3 * s + e, dtype=torch.int64)
    inv, order, ids, ends = index.split([s, s, s, e])
    weights, out = torch.empty(s, dtype=torch.float32), torch.empty_like(x)
    rc = entry(table.data_ptr(), x.data_ptr(), logits.data_ptr(), t, h, e, top_k, int(norm_topk),
               int(scores_fp32 and dtype != torch.float32), gate_up.data_ptr(), down.data_ptr(), i, xg.data_ptr(),
               gu.data_ptr(), act.data_ptr(), dn.data_ptr(), inv.data_ptr(), order.data_ptr(), ends.data_ptr(),
               weights.data_ptr(), ids.data_ptr(), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"moe_block_{_SUFFIX[dtype]} failed ({rc}): out of memory, or a shape its kernels refuse")
    return out, ids.view(t, top_k)


class ExpertPanels(torch.nn.Module):
    """One of an experts module's 3-D weights, [E, n, k], as a derived module's `weight`
    (engine/kernels/derived_weights.py): its copy is every expert's [n, k] as panels, one after another
    (f32_linears.pack of [E * n, k]), made and swapped by a push as a linear's copy is. Holds no parameter."""

    def __init__(self, experts: torch.nn.Module, name: str):
        super().__init__()
        self._of = (experts, name)  # a tuple: not a submodule (modules() would walk back up)

    @property
    def weight(self) -> torch.Tensor:
        experts, name = self._of
        return getattr(experts, name)


def _pack_experts(weight: torch.Tensor, into=None) -> f32_linears.F32Weight:
    return f32_linears.pack(weight.reshape(-1, weight.shape[-1]), into=into)


_pack_experts.takes_parts = True  # (one tensor; a retired copy's memory)
_HOLDERS = (("gate_up_proj", "gate_up_panels"), ("down_proj", "down_panels"))


def attach_panels(blocks) -> int:
    """Serve the experts of each of `blocks` (sparse MLPs: a router and 3-D experts) over copies of their
    weights as panels where `panels` says so and their widths are whole panels; returns how many."""
    count = 0
    for block in blocks:
        e = block.experts
        weights = [getattr(e, name) for name, _ in _HOLDERS]
        if not (panels(weights[0].dtype) and all(w.dtype == weights[0].dtype and w.dim() == 3 for w in weights)
                and all(w.shape[1] % f32_linears.PANEL == 0 for w in weights)):
            continue
        for name, holder in _HOLDERS:
            setattr(e, holder, ExpertPanels(e, name))
            derived_weights.attach(getattr(e, holder), _pack_experts)
        count += 1
    return count


def served_panels(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gate_up's, down's) panels the experts are served from now (attach_panels; derived again if a
    weight changed), or None where they run on their weights in place."""
    holders = [getattr(experts, holder, None) for _, holder in _HOLDERS]
    if holders[0] is None:
        return None
    return tuple(derived_weights.current(h).packed for h in holders)

