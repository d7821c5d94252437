"""The two ways experts are named: per expert, as checkpoints store them (`mlp.experts.3.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.3.w1.weight`), and fused, as transformers 5 models hold them
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows then up rows, and `mlp.experts.down_proj` [E, H, I]).

`expert_part` maps a per-expert name to where its tensor lies in the fused one; a per-expert
tensor is a contiguous block of it (expert e's gate rows, its up rows, its down matrix), which is
how a push of per-expert names lands in the fused parameters without a copy of its own.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

_PER_EXPERT = re.compile(r"^(?P<layer>.*\.)(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                         r"(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_GATE = re.compile(r"^(?P<layer>.*\.)block_sparse_moe\.gate\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class ExpertPart(NamedTuple):
    fused: str  # the fused parameter's name
    expert: int
    part: str  # "gate", "up" or "down"


def expert_part(name: str) -> ExpertPart | None:
    """Where the per-expert tensor `name` lies in the fused parameters (None: not a per-expert name)."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    part = _PART[m["part"]]
    fused = f"{m['layer']}mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}"
    return ExpertPart(fused, int(m["e"]), part)


def fused_name(name: str) -> str:
    """`name` as a transformers 5 model holds it (Mixtral's `block_sparse_moe.gate` is `mlp.gate`)."""
    m = _MIXTRAL_GATE.match(name)
    return f"{m['layer']}mlp.gate.weight" if m else name


def block(fused: torch.Tensor, part: ExpertPart) -> torch.Tensor:
    """The view of the fused parameter that per-expert tensor `part` is."""
    if part.part == "down":
        return fused[part.expert]
    half = fused.shape[1] // 2
    return fused[part.expert, :half] if part.part == "gate" else fused[part.expert, half:]


def fuse_checkpoint(state: dict[str, torch.Tensor], cfg=None) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under a transformers 5 model's names: each layer's per-expert tensors
    stacked into its two fused ones. Returns `state` itself when it has no per-expert names; a
    layer missing some expert's tensor keeps its per-expert names (the caller sees names that do
    not fit and loads it another way)."""
    del cfg
    parts: dict[str, dict[tuple[int, str], tuple[str, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        p = expert_part(name)
        if p is None:
            out[fused_name(name)] = t
            continue
        prefix = p.fused.rsplit(".", 1)[0]
        if prefix not in parts:  # the fused pair takes the place of the layer's first expert tensor
            out[f"{prefix}.gate_up_proj"] = out[f"{prefix}.down_proj"] = None
        parts.setdefault(prefix, {})[(p.expert, p.part)] = (name, t)
    for prefix, got in parts.items():
        experts = 1 + max(e for e, _ in got)
        if len(got) != 3 * experts:
            del out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"]
            out.update(dict(got.values()))
            continue
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([got[e, "gate"][1], got[e, "up"][1]])
                                                     for e in range(experts)])
        out[f"{prefix}.down_proj"] = torch.stack([got[e, "down"][1] for e in range(experts)])
    return out
