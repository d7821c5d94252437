"""LoRA adapter pushes: the trainer sends a PEFT model's adapter (a few MB) instead of the whole
model, and the engine merges it into the base it keeps: `W = W0 + scale * B @ A` for each target
module, from the base `W0` every time, so repeated pushes never accumulate rounding.

Wire: an adapter push is an ordinary manifest (same buckets, votes and all-or-nothing commit)
whose tensors are `<module>.lora_A` [r, in] and `<module>.lora_B` [out, r] under the module's HF
name, with `Manifest.adapter` saying which base they apply to (`base_id`, a checksum of the
trainer's base weights) and each module's scale. An engine whose base is not that one votes
"needs base" before any byte moves; the trainer then pushes once more with the base weights in
the same manifest (`with_base`), which the engine keeps as `W0`. The merge is PEFT's own
arithmetic (`LoraLayer.get_delta_weight`, then `weight += delta`; engine/lora_merge.py), so the
engine's weights are bit for bit the trainer's `merge_and_unload()` on the same kind of device.

Supported: LoRA and rsLoRA on linear layers (any `target_modules`, ranks and alphas, per-module
patterns), one active adapter, `bias="none"`. DoRA, trained biases, `modules_to_save` and LoRA on
embeddings are refused with a clear error: push them with `mode="merged"`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.lora_merge import merge  # the arithmetic is the engine's: lora_target and merged_weights use it
from weight_sync.checksum import dedup_tied, weights_checksum
from weight_sync.manifest import DTYPES, FLOAT_DTYPES, AdapterSpec, Manifest, ParamInfo, check_layout, check_names

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
MODES = ("adapter", "merged")
MAX_RANK = 4096  # beyond this an "adapter" is no longer low rank: push it merged


# -- trainer side -------------------------------------------------------------------------------
def is_peft_model(model) -> bool:
    return isinstance(model, torch.nn.Module) and hasattr(model, "peft_config") and hasattr(model, "get_base_model")


# PEFT options whose effect lives outside lora_A / lora_B: an adapter push would leave it behind
_NOT_CARRIED = ("lora_bias", "trainable_token_indices", "alora_invocation_tokens")


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """HF module name -> PEFT LoRA layer of a PEFT model; raises for what an adapter push cannot carry."""
    config = model.peft_config.get(model.active_adapter) if hasattr(model, "active_adapter") else None
    if config is None or len(model.peft_config) != 1:
        raise ValueError(f"an adapter push carries one adapter; this model has {sorted(model.peft_config)}: "
                         "push with mode='merged'")
    if getattr(config, "peft_type", None) is not None and str(config.peft_type.value) != "LORA":
        raise ValueError(f"adapter pushes carry LoRA adapters, not {config.peft_type.value}: push with mode='merged'")
    if getattr(config, "bias", "none") != "none" or getattr(config, "modules_to_save", None):
        raise ValueError("an adapter push carries lora_A and lora_B only: bias='none' and no modules_to_save, "
                         "or push with mode='merged'")
    for option in _NOT_CARRIED:
        if getattr(config, option, None):
            raise ValueError(f"an adapter push carries lora_A and lora_B only, not {option}: push with mode='merged'")
    from weight_sync.trainer_ranks import has_peers

    if has_peers() and any(hasattr(p, "full_tensor") for p in model.parameters()):
        raise ValueError("LoRA pushes from a sharded trainer of several ranks (FSDP2) are not supported: gather "
                         "the model on rank 0, or train with DDP")
    name = model.active_adapter
    layers = {}
    for module_name, module in model.get_base_model().named_modules():
        if not hasattr(module, "lora_A") or name not in module.lora_A:
            continue
        if getattr(module, "use_dora", {}).get(name, False):
            raise ValueError(f"{module_name}: DoRA adapters are not carried by an adapter push: mode='merged'")
        base = module.get_base_layer()
        if type(base) is not torch.nn.Linear or module.fan_in_fan_out or not base.weight.is_floating_point():
            raise ValueError(f"{module_name}: adapter pushes carry LoRA on plain floating nn.Linear layers only "
                             f"(found {type(base).__name__}, {base.weight.dtype}; a quantized base (QLoRA) "
                             "cannot be pushed or merged as it is): mode='merged' on a dequantized model")
        layers[module_name] = module
    if not layers:
        raise ValueError("this PEFT model has no LoRA layer for its active adapter")
    return layers


def adapter_weights(model) -> tuple[list[tuple[str, torch.Tensor]], dict[str, float]]:
    """The adapter's tensors under the names an adapter manifest uses, and each module's scale."""
    name = model.active_adapter
    named, scales = [], {}
    for module_name, layer in lora_layers(model).items():
        named.append((module_name + A_SUFFIX, layer.lora_A[name].weight.detach()))
        named.append((module_name + B_SUFFIX, layer.lora_B[name].weight.detach()))
        scales[module_name] = float(layer.scaling[name])
    return named, scales


def base_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The frozen base's parameters under their HF names (what the engine loaded from disk)."""
    named = [(n.replace(".base_layer.", "."), p.detach()) for n, p in model.get_base_model().named_parameters()
             if ".lora_" not in n]
    return dedup_tied(named)


def base_id(model) -> str:
    """A checksum of the base weights, computed once per model while they stay unchanged (each
    tensor's address and version counter say so): the base is frozen in LoRA training."""
    base = base_weights(model)
    key = tuple((t.data_ptr(), t._version) for _, t in base)
    cached = getattr(model, "_rollout_base_id", None)
    if cached is None or cached[0] != key:
        cached = (key, weights_checksum(base))
        object.__setattr__(model, "_rollout_base_id", cached)
    return cached[1]


def merged_weights(model) -> list[tuple[str, torch.Tensor]]:
    """What `merge_and_unload()` would give, without touching the trainer's model: the base with
    each target module's weight replaced by a merged copy (PEFT's arithmetic)."""
    name = model.active_adapter
    layers = lora_layers(model)
    merged = {}
    with torch.no_grad():
        for module_name, layer in layers.items():
            w0 = layer.get_base_layer().weight
            merged[module_name + ".weight"] = merge(w0, layer.lora_A[name].weight, layer.lora_B[name].weight,
                                                    float(layer.scaling[name]))
    return [(n, merged.get(n, t)) for n, t in base_weights(model)]


@dataclass(frozen=True)
class AdapterPush:
    """What an adapter push sends (WeightSender.prepare lists it): the adapter, and the base too
    when an engine lacks it."""

    model: torch.nn.Module
    with_base: bool = False

    def listing(self) -> tuple[list[tuple[str, torch.Tensor]], AdapterSpec]:
        named, scales = adapter_weights(self.model)
        if self.with_base:
            named = base_weights(self.model) + named
        return named, AdapterSpec(base_id=base_id(self.model), scales=scales, with_base=self.with_base)


def push_source(weights, mode: str = "adapter"):
    """What a push of `weights` sends: a PEFT model's adapter (mode "adapter") or its merged
    weights (mode "merged"); anything else as it is."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(weights, torch.nn.Module):
        from weight_sync.trainer_weights import unwrap_model

        if is_peft_model(unwrap_model(weights)):  # a PEFT model under DDP / torch.compile
            weights = unwrap_model(weights)
    if isinstance(weights, AdapterPush) or not is_peft_model(weights):
        return weights
    if mode == "merged":
        return merged_weights(weights)
    lora_layers(weights)  # refuse what an adapter push cannot carry before anything moves
    return AdapterPush(weights)


# -- engine side: validation (pure) -------------------------------------------------------------
def adapter_problems(m: Manifest, params: Mapping[str, ParamInfo], aliases: Mapping[str, str] | None = None
                     ) -> list[str]:
    """Every problem that makes adapter manifest `m` unacceptable for a model with `params`: the
    base part (if any) as a full push, and for each target module a `lora_A` [r, in] and `lora_B`
    [out, r] of floating dtypes matching the module's weight [out, in], a sane rank and a finite
    scale. An empty list: the push can go ahead."""
    spec = m.adapter
    lora = [t for t in m.tensors if t.name.endswith((A_SUFFIX, B_SUFFIX))]
    base = [t for t in m.tensors if not t.name.endswith((A_SUFFIX, B_SUFFIX))]
    problems = check_layout(m)
    if spec.with_base:
        problems += check_names(base, params, aliases)
    elif base:
        problems.append(f"an adapter push without its base carries only lora_A / lora_B tensors, got "
                        f"{[t.name for t in base[:4]]}")
    by_name = {t.name: t for t in lora}
    modules = {t.name.rsplit(".", 1)[0] for t in lora}
    if modules != set(spec.scales):
        problems.append(f"modules with tensors {sorted(modules)[:4]} != modules with scales {sorted(spec.scales)[:4]}")
    for module in sorted(spec.scales):
        a, b = by_name.get(module + A_SUFFIX), by_name.get(module + B_SUFFIX)
        w = params.get(module + ".weight")
        if aliases and module + ".weight" in aliases:
            problems.append(f"{module}: its weight is tied to {aliases[module + '.weight']}; an adapter on it would "
                            "change both: push with mode='merged'")
            continue
        if w is None or len(w.shape) != 2:
            problems.append(f"{module}: the model has no linear layer of that name")
            continue
        if a is None or b is None:
            problems.append(f"{module}: needs both {A_SUFFIX} and {B_SUFFIX}")
            continue
        out_f, in_f = w.shape
        r = a.shape[0] if len(a.shape) == 2 else -1
        if not 1 <= r <= MAX_RANK or tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
            problems.append(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not make a rank-r "
                            f"update of its weight {list(w.shape)} (want [r, {in_f}] and [{out_f}, r], 1 <= r <= "
                            f"{MAX_RANK})")
        if a.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES or w.dtype not in FLOAT_DTYPES:
            problems.append(f"{module}: LoRA needs floating dtypes, got {a.dtype}/{b.dtype} for a {w.dtype} weight")
        if not math.isfinite(spec.scales[module]):
            problems.append(f"{module}: scale {spec.scales[module]} is not finite")
    return problems


def adapter_views(m: Manifest, staging: torch.Tensor) -> dict[str, torch.Tensor]:
    """Name -> the tensor's bytes in the staging buffer, as its dtype and shape."""
    return {t.name: staging[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape) for t in m.tensors}
