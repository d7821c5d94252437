"""LoRA adapter pushes, the trainer's side (the wire and the arithmetic: weight_sync/common/lora.py):
a PEFT model's adapter, its frozen base and its merged weights, as a push sends them.

Supported: LoRA and rsLoRA on linear layers (any `target_modules`, ranks and alphas, per-module
patterns), one active adapter, `bias="none"`. DoRA, trained biases, `modules_to_save` and LoRA on
embeddings are refused with a clear error: push them with `mode="merged"`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.lora_merge import merge  # the arithmetic is the engine's: the trainer's merged weights are its bits
from weight_sync.common.checksum import dedup_tied, weights_checksum
from weight_sync.common.lora import A_SUFFIX, B_SUFFIX
from weight_sync.common.manifest import AdapterSpec

MODES = ("adapter", "merged")


def is_peft_model(model) -> bool:
    return isinstance(model, torch.nn.Module) and hasattr(model, "peft_config") and hasattr(model, "get_base_model")


# PEFT options whose effect lives outside lora_A / lora_B: an adapter push would leave it behind
_NOT_CARRIED = ("lora_bias", "trainable_token_indices", "alora_invocation_tokens")


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """HF module name -> PEFT LoRA layer of a PEFT model; raises for what an adapter push cannot carry.
    Found once per model and adapter (a walk over every module took ~10 ms of each adapter push): a
    LoRA layer comes or goes only with an adapter added or deleted, which the key sees; each layer
    found is checked again, cheaply, every time."""
    key = _adapter_key(model)
    return _kept(model, "_rollout_lora_layers", key, lambda: _find_lora_layers(model),
                 lambda layers: all(_still_lora(m, key[0]) for m in layers.values()))


def _kept(model, attr: str, key, make, still=lambda value: True):
    """`make()`, kept on `model` under `attr` while `key` is the same (and `still(value)` holds)."""
    cached = getattr(model, attr, None)
    if cached is None or cached[0] != key or not still(cached[1]):
        cached = (key, make())
        object.__setattr__(model, attr, cached)
    return cached[1]


def _adapter_key(model) -> tuple:
    config = getattr(model, "peft_config", {})
    return getattr(model, "active_adapter", None), tuple(config), tuple(id(c) for c in config.values())


def _still_lora(module, name) -> bool:
    return name in getattr(module, "lora_A", ()) and not getattr(module, "use_dora", {}).get(name, False)


def _find_lora_layers(model) -> dict[str, torch.nn.Module]:
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
    from weight_sync.trainer.ranks import has_peers

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
    """The frozen base's parameters under their HF names (what the engine loaded from disk); the
    parameters found once per model and adapter, as `lora_layers` (their values read each call)."""
    params = _kept(model, "_rollout_base_params", _adapter_key(model),
                   lambda: [(n.replace(".base_layer.", "."), p) for n, p in model.get_base_model().named_parameters()
                            if ".lora_" not in n])
    return dedup_tied([(n, p.detach()) for n, p in params])


def base_id(model) -> str:
    """A checksum of the base weights, computed once per model while they stay unchanged (each
    tensor's address and version counter say so): the base is frozen in LoRA training."""
    base = base_weights(model)
    return _kept(model, "_rollout_base_id", tuple((t.data_ptr(), t._version) for _, t in base),
                 lambda: weights_checksum(base))


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
        from weight_sync.trainer.weights import unwrap_model

        if is_peft_model(unwrap_model(weights)):  # a PEFT model under DDP / torch.compile
            weights = unwrap_model(weights)
    if isinstance(weights, AdapterPush) or not is_peft_model(weights):
        return weights
    if mode == "merged":
        return merged_weights(weights)
    lora_layers(weights)  # refuse what an adapter push cannot carry before anything moves
    return AdapterPush(weights)
