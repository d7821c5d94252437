"""Unmerged LoRA (EngineConfig.lora_versions > 0): the engine keeps its base weights as they are
and several adapter versions beside them, and each sequence decodes with the adapter it started
under, so that with a `keep` pause a rollout begun under version k finishes under k (TRL's async
GRPO and vLLM's adapter RFC keep versions for this reason). The default (0) merges each adapter
into the weights instead (weight_sync/engine_side/lora_target.py): faster per token, one version at a time.

Each target linear layer gets a forward hook adding `(x @ A^T @ B^T) * scale` for the rows of
each adapter version in the step (PEFT's own order of operations, so the output equals PEFT's
unmerged forward). The model runner says which version each row uses (`assign`) before the forward.
At most `max_versions` are kept: when a push would exceed it the oldest goes, and sequences that
used it move on to the newest (their tokens are tagged with it from then on).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.kernels.lora_merge import merge

Factors = dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module name -> (A [r, in], B [out, r], scale)


class LoraBank:
    def __init__(self, model: torch.nn.Module, max_versions: int):
        if max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {max_versions}")
        self.max_versions = max_versions
        self.versions: OrderedDict[int, Factors] = OrderedDict()  # oldest first
        self._hooks: dict[str, object] = {}
        self._model = model
        self._groups: list[tuple[int, torch.Tensor | None]] = []  # this step: (version, rows or None = all)

    @property
    def active(self) -> bool:
        return bool(self.versions)

    @property
    def newest(self) -> int | None:
        return next(reversed(self.versions)) if self.versions else None

    def add(self, version: int, factors: Factors, reset: bool = False) -> None:
        """A committed adapter version (after a push's swap point: no step runs meanwhile).
        `reset`: the base changed, so every earlier version is meaningless and goes."""
        if reset:
            self.versions.clear()
        self.versions[int(version)] = factors
        while len(self.versions) > self.max_versions:
            self.versions.popitem(last=False)
        self._hook(set().union(*(f.keys() for f in self.versions.values())))

    def clear(self) -> None:
        """The weights were replaced whole (a full push, a reload): no adapter applies any more."""
        self.versions.clear()
        self._hook(set())

    def bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for f in self.versions.values() for a, b, _ in f.values())

    # -- the step -----------------------------------------------------------------------------
    def assign(self, seqs: list, rows_per_seq: list[int]) -> list[int] | None:
        """Give each sequence its version (the one it has, if still kept, else the newest) and
        group this step's rows by version; returns each sequence's version (None: no adapter)."""
        if not self.versions:
            self._groups = []
            return None
        versions = []
        for seq in seqs:
            if getattr(seq, "lora_version", None) not in self.versions:
                seq.lora_version = self.newest
            versions.append(seq.lora_version)
        if len(set(versions)) == 1:
            self._groups = [(versions[0], None)]
        else:
            per_row = torch.repeat_interleave(torch.tensor(versions), torch.tensor(rows_per_seq))
            device = next(self._model.parameters()).device
            self._groups = [(v, torch.nonzero(per_row == v).flatten().to(device)) for v in sorted(set(versions))]
        return versions

    def end_step(self) -> None:
        self._groups = []  # a forward outside a step (the health probe) runs on the base

    def merged(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` with the newest adapter merged, if it targets module `name` (for a copy of
        the weights a restarted engine loads: weight_sync's save_weights)."""
        f = self.versions[self.newest].get(name) if self.versions else None
        return weight if f is None else merge(weight, f[0], f[1], f[2])

    # -- hooks --------------------------------------------------------------------------------
    def _hook(self, names: set[str]) -> None:
        modules = dict(self._model.named_modules())
        for name in list(self._hooks):
            if name not in names:
                self._hooks.pop(name).remove()
        for name in names - set(self._hooks):
            self._hooks[name] = modules[name].register_forward_hook(self._make_hook(name))

    def _make_hook(self, name: str):
        def hook(module, inputs, output):
            x = inputs[0]
            for version, rows in self._groups:
                f = self.versions[version].get(name)
                if f is None:
                    continue
                a, b, scale = f
                if rows is None:
                    output += (x @ a.T @ b.T) * scale
                else:  # rows of the flattened [1, T, features] step
                    xs = x[0, rows]
                    output[0].index_add_(0, rows, (xs @ a.T @ b.T) * scale)
            return output

        return hook
