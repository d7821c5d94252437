"""The engine's side of LoRA adapter pushes (a mixin of `WeightSyncExtension`,
weight_sync/receiver.py; the arithmetic and the checks are in weight_sync/lora.py).

The worker keeps, for each module an adapter targets, its base weight `W0` (the tensor the
module held before its first merge, or the one a `with_base` push brought): no copy, only a
reference. Each adapter push computes every target's `W0 + scale * B @ A` into new tensors while
the bytes are still the engine's to refuse (before the commit vote, on the receiving thread when
the push is overlapped); the commit then points each module at its new tensor, so the pause does
not grow with the model, and W0 is never written. A full push, a reload or a catch-up makes the
weights a base of unknown identity again (`base_id` None): the next adapter push brings its base.

With unmerged LoRA (EngineConfig.lora_versions > 0, engine/lora_bank.py) the weights stay the
base and the commit adds the adapter's factors to the worker's LoRA bank as a new version instead.
"""

from __future__ import annotations

import torch

from weight_sync.lora import A_SUFFIX, B_SUFFIX, adapter_problems, adapter_views, merge
from weight_sync.manifest import Manifest, model_params, param_infos

NEEDS_BASE = ("this engine does not hold the adapter's base (its first adapter push, a restarted engine, or a "
              "different base): the trainer pushes again with the base")


class AdapterReceive:
    def _ws_check_adapter(self, m: Manifest) -> list[str]:
        """An adapter manifest against this worker's model; [NEEDS_BASE] when only the base is lacking."""
        params, aliases = model_params(self.model)
        problems = adapter_problems(m, param_infos(params), aliases)
        if getattr(self, "lora_bank", None) is not None and self._targets_head(m):
            problems.append("unmerged LoRA (lora_versions > 0) does not adapt the output head: leave it out of "
                            "target_modules, or run the engine with adapters merged")
        if not problems and not m.adapter.with_base and self._ws().base_id != m.adapter.base_id:
            return [NEEDS_BASE]
        return problems

    def _targets_head(self, m: Manifest) -> bool:
        """Whether the adapter targets the output head (only unmerged LoRA needs to know: a walk
        over the modules, not paid by a merging engine's every push)."""
        modules, head = dict(self.model.named_modules()), self.model.get_output_embeddings()
        return any(modules.get(n) is head for n in m.adapter.scales)

    def _ws_plan_adapter(self, m: Manifest, staging: torch.Tensor) -> dict:
        """Every byte is in: the new value of each parameter the push changes (the base's, when it
        came with the push, then each target's merge from its W0), for `_ws_commit` to swap in."""
        st = self._ws()
        params, aliases = model_params(self.model)
        views = adapter_views(m, staging)
        spec = m.adapter
        new: dict[str, torch.Tensor] = {}
        w0 = {} if spec.with_base else dict(st.w0 or {})
        if spec.with_base:
            for t in m.tensors:
                if not t.name.endswith((A_SUFFIX, B_SUFFIX)):
                    name = t.name if t.name in params else aliases[t.name]
                    v = views[t.name]
                    new[name] = v if v.dtype == params[name].dtype else v.to(params[name].dtype)
        if getattr(self, "lora_bank", None) is not None:  # unmerged: the base stays, the factors go to the bank
            def factor(name: str, module: str) -> torch.Tensor:  # in the layer's dtype (a bf16 engine, fp32 trainer)
                w = params[module + ".weight"]
                return views[name].to(device=w.device, dtype=w.dtype, copy=True)

            factors = {module: (factor(module + A_SUFFIX, module), factor(module + B_SUFFIX, module), scale)
                       for module, scale in spec.scales.items()}
            return {"targets": [params[n] for n in new], "views": list(new.values()), "swap": True, "w0": None,
                    "base_id": spec.base_id, "factors": factors}
        spare, st.lora_spare = st.lora_spare or {}, None
        retired = {}
        with torch.no_grad():
            for module, scale in spec.scales.items():
                name = module + ".weight"
                base = w0.get(name, new.get(name, params[name].data))
                w0[name] = base
                current = params[name].data
                if current.data_ptr() != base.data_ptr() and _owns_storage(current):  # the last merge
                    retired[name] = current  # free once this one commits
                new[name] = merge(base, views[module + A_SUFFIX].to(params[name].device),
                                  views[module + B_SUFFIX].to(params[name].device), scale, out=spare.get(name))
            for name, base in w0.items():  # a module an earlier adapter targeted and this one does not
                new.setdefault(name, base)
        targets = [params[n] for n in new]
        return {"targets": targets, "views": list(new.values()), "swap": True, "w0": w0, "base_id": spec.base_id,
                "retired": retired}

    def _ws_adapter_committed(self, m: Manifest, staging: torch.Tensor, plan: dict) -> None:
        st = self._ws()
        st.w0, st.base_id = plan["w0"], plan["base_id"]
        if st.keep_staging:  # CPU: the last merge's memory takes the next merge (fresh pages fault in slowly)
            st.lora_spare = plan.get("retired")
        if plan.get("factors") is not None:
            self.lora_bank.add(m.version, plan["factors"], reset=m.adapter.with_base)
        if not m.adapter.with_base:
            self._ws_release(staging)  # the factors are merged: the buffer is free for the next push


def _owns_storage(t: torch.Tensor) -> bool:
    """A tensor alone in its storage (a merge's output), not a view into a push's staging buffer."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
