"""Where a push's tensors go: a `WeightTarget` says what a push must look like for an engine and
commits `(name, tensor)` pairs into it, as nano-vllm's `weight_loader(param, tensor)`, TRL's
`load_weights(weights=[(name, weight)])` and vLLM's `reload_weights(weights_iterator=...)` do.
The protocol of a push (votes, staging, all or nothing) is `weight_sync.engine_side.receive.PushReceiver`'s;
a target only knows its engine's weights.

Targets: `ParamsTarget` (a HF model's parameters: the commit is a pointer swap, no copy;
weight_sync/engine_side/params_target.py), which hands adapter pushes to its `LoraMergeTarget` (the LoRA merge,
weight_sync/engine_side/lora_target.py), and `VllmLoaderTarget` (vLLM's loaders, weight_sync/vllm/target.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from weight_sync.common.manifest import DTYPES, Manifest

Pairs = Iterable[tuple[str, torch.Tensor]]


class TornWeights(RuntimeError):
    """A commit failed after it began writing: the engine holds part of two versions and must be
    restarted (it reports itself unhealthy until then). Its kind crosses the engine's boundary as
    data (engine/messages.py): the caller gets an EngineUnhealthyError and restarts that engine."""

    error_kind = "unhealthy"


@dataclass
class CommitPlan:
    """A commit worked out while the bytes arrive: each `(name, tensor)` pair, the tensor a view
    of `staging` (or, for an adapter, the merge computed from it); `params` the parameter objects
    the pairs go to, where the target swaps pointers."""

    staging: torch.Tensor
    pairs: list[tuple[str, torch.Tensor]]
    params: list = field(default_factory=list)
    swap: bool = False
    extra: dict = field(default_factory=dict)  # what one target needs beyond the pairs (a LoRA base)
    derived: object = None  # the engine's copies derived from the staged pairs (`WeightTarget.derive`)


class WeightTarget(Protocol):
    def check(self, m: Manifest) -> list[str]:
        """Every reason this engine cannot take `m` ([] : it can); nothing is touched."""

    def plan_needs_bytes(self, m: Manifest) -> bool:
        """Whether `plan` reads the staged values (an adapter's merge) or only their place."""

    def plan(self, m: Manifest, staging: torch.Tensor) -> CommitPlan: ...

    def derive(self, m: Manifest, plan: CommitPlan, changed: set[int] | None = None) -> None:
        """Once every byte is staged: what the engine serves from the weights (its derived copies:
        prepacked, 8-bit) made now from the staged pairs, while the engine still serves the old
        ones, into `plan.derived` for the commit to swap in. `changed`: the indices of `m`'s tensors
        whose values differ from the served ones (a delta's; None: all)."""

    def commit(self, m: Manifest, plan: CommitPlan) -> torch.Tensor | None:
        """Make the planned pairs the served weights, all of them or none (raises TornWeights if it
        failed after writing). Returns memory the commit set free (the next push's staging)."""

    def commit_stream(self, m: Manifest, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Write pairs as they arrive (the in-place receive: no staging copy, so no all or nothing)."""

    def served(self) -> Pairs:
        """The weights as served, under the pushed names: for checksums and copies to other engines."""

    def base(self, m: Manifest) -> list[torch.Tensor]:
        """The weights last committed, one per tensor of `m` (names checked), without copying: the
        base a delta push applies to (weight_sync/common/delta_push.py). Raises if they are not kept."""

    def forget(self) -> None:
        """The weights were replaced outside a push (a reload) or released: nothing about them is known."""


def views(m: Manifest, staging: torch.Tensor, rename=lambda name: name) -> list[tuple[str, torch.Tensor]]:
    """Each manifest tensor's bytes in `staging`, as its dtype and shape, under `rename(name)`."""
    return [(rename(t.name), staging[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape))
            for t in m.tensors]


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
