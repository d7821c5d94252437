"""Routing replay (R3, arXiv 2510.11370) in a trainer's forward: a transformers 5 mixture of experts
routes each token to the experts the engine routed it to (`SamplingParams.return_routed_experts`),
its gate weights recomputed from its own router logits over those experts, so that the loss and the
old-policy logprobs see the experts that produced the tokens.

Without it, trainer and engine disagree on some router decisions (different kernels, bf16 against
fp32), and a token's logprob in the loss comes from experts that did not sample it.

    ids, mask = align(out.routed_experts, start, len(prompt) + len(completion))
    with replay(model, ids[None], mask[None]):
        logits = model(input_ids).logits

`routing_mismatch` measures what replay removes: the share of tokens whose own routing differs from
the engine's in any layer (logged per step by the recipes that replay).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (transformers 5's `*TopKRouter`: `mlp.gate`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def align(routed: np.ndarray, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's engine routes laid on its positions 0..length-1: (ids [length, layers, k] int64,
    mask [length] bool: which positions have a route). `routed` starts at position `start`
    (routed_experts_prompt_start); positions before it and past its rows keep their own routing."""
    rows = torch.from_numpy(np.asarray(routed).astype(np.int64))
    ids = torch.zeros(length, *rows.shape[1:], dtype=torch.int64)
    n = max(0, min(len(rows), length - start))
    ids[start:start + n] = rows[:n]
    mask = torch.zeros(length, dtype=torch.bool)
    mask[start:start + n] = True
    return ids, mask


def _replayed(router: torch.nn.Module, out, ids: torch.Tensor, mask: torch.Tensor):
    """The router's (logits, weights, ids) with `ids` where `mask`: the weights are its own
    softmax over all experts taken at the chosen ids, renormalised as the router renormalises."""
    logits, _, own = out
    chosen = torch.where(mask[:, None], ids.to(own.device), own)
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):  # Mixtral's router always renormalises
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not type(router).__name__.startswith("Mixtral"):  # Mixtral's keeps them in fp32
        weights = weights.to(logits.dtype)
    return logits, weights, chosen


@contextlib.contextmanager
def replay(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Iterator[list[torch.Tensor]]:
    """Within it, the model's forwards route by `ids` [B, T, layers, k] where `mask` [B, T] (the
    forward's input is [B, T]); yields the ids each router used, appended per forward and layer."""
    found = routers(model)
    if not found:
        raise ValueError("routing replay: this model has no MoE routers (transformers' *TopKRouter modules)")
    if ids.shape[2] != len(found):
        raise ValueError(f"routing replay: {ids.shape[2]} layers of routes for a model of {len(found)} MoE layers")
    flat_ids, flat_mask = ids.reshape(-1, *ids.shape[2:]), mask.reshape(-1)
    used: list[torch.Tensor] = []
    hooks = []
    for layer, router in enumerate(found):
        def hook(module, args, out, layer=layer):
            if out[0].shape[0] != flat_mask.shape[0]:
                raise ValueError(f"routing replay: routes for {flat_mask.shape[0]} tokens, a forward of {out[0].shape[0]}")
            done = _replayed(module, out, flat_ids[:, layer], flat_mask.to(out[0].device))
            used.append(done[2])
            return done
        hooks.append(router.register_forward_hook(hook))
    try:
        yield used
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def observe(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within it, the ids each router chooses by itself ([tokens, k] per forward and layer), seen
    before any replay entered inside it replaces them."""
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2].detach())) for r in routers(model)]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def own_routing(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The ids the model's routers choose on `input_ids` [B, T] by themselves: [B, T, layers, k]."""
    with observe(model) as seen, torch.no_grad():
        model(input_ids)
    return stacked(seen, *input_ids.shape)


def stacked(seen: list[torch.Tensor], b: int, t: int) -> torch.Tensor:
    """One forward's observed ids (a [B * T, k] per router) as [B, T, layers, k]."""
    return torch.stack(seen, dim=1).view(b, t, len(seen), -1)


def routing_mismatch(own: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of routed tokens (`mask`) whose set of experts differs from the engine's in at least
    one layer: own and engine [..., layers, k], mask [...] bool. Order within the top k is ignored."""
    if not mask.any():
        return 0.0
    differ = (own.sort(-1).values != engine.to(own.device).sort(-1).values).any(-1).any(-1)
    return float(differ[mask].float().mean())
