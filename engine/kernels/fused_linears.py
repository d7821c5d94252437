"""A decoder layer's q/k/v projections as one GEMM, and its gate/up as another, on a copy of
their weights stacked by rows (derived_weights' groups): at a decode step's 32-256 rows a GEMM
is bound by its calls and its weight's passes through the cache, and three calls on 576 columns
cost more than one on 960 (bench.int8_linears --fused measures it per shape).

The parameters stay the modules' own (names, pushes, checksums, LoRA see HF's model); only the
serving copy is shared. Each output element is still its own row of weights times the input, so
the arithmetic is the unfused copy's; a member with a forward hook on it (a LoRA adapter's), or
a forward that needs gradients, runs its modules one by one as before.
"""

from __future__ import annotations

import torch

from engine.kernels import derived_weights

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _kind(m: torch.nn.Module) -> tuple:
    """What must agree for modules to share a copy: how they serve, in what, on what input."""
    return (getattr(m, "_apply_derived", None), getattr(m, "_packed_dtype", None), m.weight.dtype,
            m.weight.shape[1], m.bias is None, derived_weights.in_place(m))


def group(model: torch.nn.Module) -> int:
    """Serve each decoder layer's q/k/v and gate/up from one copy each where their modules serve
    from derived copies of one kind (prepacked, int8, fp8); returns how many groups."""
    layers = getattr(getattr(model, "model", None), "layers", ())
    count = 0
    for layer in layers:
        for parent_name, names in GROUPS:
            parent = getattr(layer, parent_name, None)
            members = [getattr(parent, n, None) for n in names]
            if parent is None or any(not isinstance(m, torch.nn.Linear) for m in members):
                continue
            kinds = {_kind(m) for m in members}
            if len(kinds) != 1 or next(iter(kinds))[0] is None:
                continue
            g = derived_weights.attach_group(model, members, members[0]._derive)
            g.sizes = [m.weight.shape[0] for m in members]
            parent._fused = g
            count += 1
    return count


def project(parent: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The outputs of `parent`'s grouped projections of x, one GEMM for all; None when they must
    run one by one (no group, a hook on a member, gradients wanted)."""
    g = getattr(parent, "_fused", None)
    if g is None or torch.is_grad_enabled() or any(m._forward_hooks or m._forward_pre_hooks for m in g.members):
        return None
    first = g.members[0]
    bias = None if first.bias is None else torch.cat([m.bias for m in g.members])
    return first._apply_derived(first, x, derived_weights.current_group(g), bias).split(g.sizes, dim=-1)
