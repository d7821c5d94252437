"""A sparse MLP's maths as pure functions: the router's top-k choice and the experts' weighted sum.

`route` is HF's TopKRouter (softmax in fp32, top-k, optionally renormalised). `run` groups the
step's (token, slot) picks by expert and runs each active expert once over its tokens (one grouped
GEMM call: one pass over each active expert's weights a step, however many tokens chose it, no
Python loop over experts), in the operations and order of transformers' default experts forward,
so its output has HF's bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


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
