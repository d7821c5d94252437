"""The LoRA merge: where an adapter push's tensors go on our engine (the arithmetic and the checks
are in weight_sync/common/lora.py; `ParamsTarget` hands adapter manifests here).

The target keeps, for each module an adapter targets, its base weight `W0` (the tensor the module
held before its first merge, or the one a `with_base` push brought): no copy, only a reference.
Each adapter push computes every target's `W0 + scale * B @ A` into new tensors while the bytes are
still the engine's to refuse (before the commit vote, on the receiving thread when the push is
overlapped); the commit then points each module at its new tensor, so the pause does not grow with
the model, and W0 is never written. A full push, a reload or a catch-up makes the weights a base of
unknown identity again (`base_id` None): the next adapter push brings its base.

With unmerged LoRA (EngineConfig.lora_versions > 0, engine/lora_bank.py) the weights stay the
base and the commit adds the adapter's factors to the worker's LoRA bank as a new version instead.
"""

from __future__ import annotations

import torch

from engine.kernels.lora_merge import merge
from weight_sync.common.lora import A_SUFFIX, B_SUFFIX, adapter_problems, adapter_views
from weight_sync.common.manifest import Manifest, model_params, param_infos
from weight_sync.engine_side.targets import CommitPlan

NEEDS_BASE = ("this engine does not hold the adapter's base (its first adapter push, a restarted engine, or a "
              "different base): the trainer pushes again with the base")


class LoraMergeTarget:
    def __init__(self, host, pool):
        self.host = host  # the worker: .model, .lora_bank
        self.pool = pool  # its `keep` says whether the last merge's memory takes the next merge
        self.base_id: str | None = None
        self.w0: dict | None = None  # target weight name -> its base tensor
        self.spare: dict | None = None  # target weight name -> a buffer for its next merge

    def check(self, m: Manifest) -> list[str]:
        """An adapter manifest against this worker's model; [NEEDS_BASE] when only the base is lacking."""
        params, aliases = model_params(self.host.model)
        problems = adapter_problems(m, param_infos(params), aliases)
        if self._bank() is not None and self._targets_head(m):
            problems.append("unmerged LoRA (lora_versions > 0) does not adapt the output head: leave it out of "
                            "target_modules, or run the engine with adapters merged")
        if not problems and not m.adapter.with_base and self.base_id != m.adapter.base_id:
            return [NEEDS_BASE]
        return problems

    def plan(self, m: Manifest, staging: torch.Tensor) -> CommitPlan:
        """Every byte is in: the new value of each parameter the push changes (the base's, when it
        came with the push, then each target's merge from its W0)."""
        params, aliases = model_params(self.host.model)
        views = adapter_views(m, staging)
        spec = m.adapter
        new: dict[str, torch.Tensor] = {}
        if spec.with_base:
            for t in m.tensors:
                if not t.name.endswith((A_SUFFIX, B_SUFFIX)):
                    name = t.name if t.name in params else aliases[t.name]
                    v = views[t.name]
                    new[name] = v if v.dtype == params[name].dtype else v.to(params[name].dtype)
        extra = {"base_id": spec.base_id}
        if self._bank() is not None:  # unmerged: the base stays, the factors go to the bank
            extra["factors"] = {module: (_factor(views, params, module, A_SUFFIX), _factor(views, params, module, B_SUFFIX),
                                         scale) for module, scale in spec.scales.items()}
        else:
            extra["w0"], extra["retired"] = self._merge(spec, params, views, new)
        return CommitPlan(staging, list(new.items()), [params[n] for n in new], swap=True, extra=extra)

    def _merge(self, spec, params: dict, views: dict, new: dict) -> tuple[dict, dict]:
        """Each target's `W0 + scale * B @ A` into `new`; returns the bases and the last merges
        this one replaces (free once it commits)."""
        w0 = {} if spec.with_base else dict(self.w0 or {})
        spare, self.spare = self.spare or {}, None
        retired = {}
        with torch.no_grad():
            for module, scale in spec.scales.items():
                name = module + ".weight"
                base = w0.get(name, new.get(name, params[name].data))
                w0[name] = base
                current = params[name].data
                if current.data_ptr() != base.data_ptr() and _owns_storage(current):  # the last merge
                    retired[name] = current
                new[name] = merge(base, views[module + A_SUFFIX].to(params[name].device),
                                  views[module + B_SUFFIX].to(params[name].device), scale, out=spare.get(name))
            for name, base in w0.items():  # a module an earlier adapter targeted and this one does not
                new.setdefault(name, base)
        return w0, retired

    def committed(self, m: Manifest, plan: CommitPlan) -> None:
        self.base_id = plan.extra["base_id"]
        factors = plan.extra.get("factors")
        if factors is not None:
            self.w0, self.spare = None, None
            self._bank().add(m.version, factors, reset=m.adapter.with_base)
            return
        self.w0 = plan.extra["w0"]
        if self.pool.keep:  # CPU: the last merge's memory takes the next merge (fresh pages fault in slowly)
            self.spare = plan.extra["retired"]

    def forget(self) -> None:
        self.base_id, self.w0, self.spare = None, None, None

    def _bank(self):
        return getattr(self.host, "lora_bank", None)

    def _targets_head(self, m: Manifest) -> bool:
        """Whether the adapter targets the output head (only unmerged LoRA needs to know: a walk
        over the modules, not paid by a merging engine's every push)."""
        modules, head = dict(self.host.model.named_modules()), self.host.model.get_output_embeddings()
        return any(modules.get(n) is head for n in m.adapter.scales)


def _factor(views: dict, params: dict, module: str, suffix: str) -> torch.Tensor:
    """An unmerged factor in its layer's dtype and device (a bf16 engine, an fp32 trainer)."""
    w = params[module + ".weight"]
    return views[module + suffix].to(device=w.device, dtype=w.dtype, copy=True)


def _owns_storage(t: torch.Tensor) -> bool:
    """A tensor alone in its storage (a merge's output), not a view into a push's staging buffer."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
