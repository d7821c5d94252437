"""A transformers 5 trainer's mixture of experts pushed into vLLM: the trainer holds each layer's
experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and Mixtral's
router as `mlp.gate`; vLLM's loaders take a checkpoint's names, one tensor an expert
(`mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`).

`FusedView` is the checkpoint's tensors as the trainer names them, to check a push against; at the
commit, `to_checkpoint` hands vLLM each fused tensor as its per-expert blocks (views: no copy),
under the checkpoint's own names. A push in the checkpoint's names goes through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.models.expert_names import ExpertPart, block, expert_part, fused_name
from weight_sync.common.manifest import ParamInfo


class FusedView:
    def __init__(self, params: dict[str, ParamInfo]):
        """`params`: the checkpoint's (name -> ParamInfo). `infos`: the same as a transformers 5
        model names them; `parts`: fused name -> [(checkpoint name, ExpertPart)]; `renamed`: the
        trainer's name -> the checkpoint's, for tensors only renamed (Mixtral's router)."""
        self.infos: dict[str, ParamInfo] = {}
        self.parts: dict[str, list[tuple[str, ExpertPart]]] = {}
        self.renamed: dict[str, str] = {}
        grouped: dict[str, dict[tuple[int, str], tuple[str, ParamInfo]]] = {}
        for name, info in params.items():
            p = expert_part(name)
            if p is None:
                self.infos[fused_name(name)] = info
                if fused_name(name) != name:
                    self.renamed[fused_name(name)] = name
            else:
                grouped.setdefault(p.fused, {})[(p.expert, p.part)] = (name, info)
        for fused, got in grouped.items():
            experts = 1 + max(e for e, _ in got)
            kinds = {part for _, part in got}
            if len(got) != experts * len(kinds):
                continue  # some expert's tensor missing: the fused name stays unknown (a clear refusal)
            first = got[0, next(iter(sorted(kinds)))][1]
            rows = first.shape[0] * (2 if "down" not in kinds else 1)
            self.infos[fused] = ParamInfo(first.dtype, (experts, rows, first.shape[1]))
            self.parts[fused] = [(name, ExpertPart(fused, e, part)) for (e, part), (name, _) in sorted(got.items())]

    def covers(self, names: Iterable[str]) -> bool:
        """Whether these are a transformers 5 model's names for this checkpoint (some fused)."""
        names = set(names)
        return bool(names & self.parts.keys()) and names <= self.infos.keys()

    def to_checkpoint(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The pairs under the checkpoint's names: a fused tensor as its per-expert blocks."""
        for name, t in pairs:
            if name in self.parts:
                for ckpt_name, part in self.parts[name]:
                    yield ckpt_name, block(t, part)
            else:
                yield self.renamed.get(name, name), t
