"""What a push sends, seen from the trainer: the (name, tensor) pairs of a model or of an
iterable, under the names the engine knows, and `flatten_parameters`, which lays a model's
parameters out as a push does.

- Wrappers (accelerate's `unwrap_model` semantics): `DistributedDataParallel` / `DataParallel` /
  DeepSpeed engines (`.module`), `torch.compile` (`_orig_mod`), FSDP1. Names are cleaned of the
  prefixes wrappers add (`module.`, `_orig_mod.`, `_fsdp_wrapped_module.`,
  `_checkpoint_wrapped_module.`), so they are the HF names the engine has.
- Sharded parameters: DTensors (FSDP2 / tensor parallel) stay sharded here and are gathered
  with `full_tensor()` when used (`full`); FSDP1 modules are read inside
  `FSDP.summon_full_params(writeback=False)` (`gather_context`).
- Tied weights are listed once, under the first name (`model.embed_tokens.weight`).
- A mixture of experts named per expert (a checkpoint's `mlp.experts.3.up_proj.weight`, Mixtral's
  `block_sparse_moe.experts.3.w3.weight`: transformers 4, or a trainer's own export) is sent as
  transformers 5 names it and the engine holds it, each layer's experts stacked into
  `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (engine/models/expert_names.py; a copy of the
  experts on the trainer's side, the only way one contiguous tensor lands in one piece).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from weight_sync.common.checksum import dedup_tied
from weight_sync.common.manifest import ALIGNMENT, plan_layout

_WRAPPER_PARTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_forward_module.")
_WRAPPER_TYPES = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine")


def clean_name(name: str) -> str:
    """The HF name under the wrappers' prefixes."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / DataParallel / DeepSpeed (`.module`) and torch.compile (`_orig_mod`) wrappers, as
    `accelerator.unwrap_model` does. FSDP1 is left in place: its parameters are read through it."""
    while True:
        orig = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(orig, torch.nn.Module):
            model = orig
        elif type(model).__name__ in _WRAPPER_TYPES and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return model


def _fsdp1_root(model: torch.nn.Module):
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except Exception:  # torch without distributed
        return None
    for m in model.modules():
        if isinstance(m, FSDP):
            return m
    return None


def gather_context(weights):
    """The context that makes the weights readable (FSDP1's summon_full_params), or None."""
    if not isinstance(weights, torch.nn.Module):
        return None
    root = _fsdp1_root(unwrap_model(weights))
    if root is None:
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.summon_full_params(root, writeback=False, recurse=True)


def list_weights(weights) -> list[tuple[str, torch.Tensor]]:
    """(clean name, detached tensor) pairs, tied duplicates dropped; read inside _gather_context."""
    if isinstance(weights, torch.nn.Module):
        named = [(clean_name(n), p.detach()) for n, p in unwrap_model(weights).named_parameters()]
        return _fused_experts(_checked(dedup_tied(named)))
    if isinstance(weights, dict):
        weights = weights.items()
    named = []
    for item in weights:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        named.append((clean_name(str(item[0])), item[1].detach()))
    return _fused_experts(_checked(dedup_tied(named)))


@contextlib.contextmanager
def named_weights(weights) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """The (clean name, tensor) pairs to push, tied duplicates dropped, inside whatever context
    makes them readable (FSDP1's summon_full_params). DTensors stay sharded: gather them with
    `full_tensor()` when they are used."""
    with gather_context(weights) or contextlib.nullcontext(), torch.no_grad():
        yield list_weights(weights)


def flatten_parameters(model: torch.nn.Module, shared: bool = False) -> torch.Tensor:
    """Move a model's parameters into one flat buffer laid out exactly as a push lays them out
    (push order, tied weights once, ALIGNMENT-aligned offsets): every bucket of a later push is
    then a slice of that buffer and goes on the wire with no packing copy, which on CPU is the
    cost that separates a push from a raw broadcast. Parameters keep their identity (optimizer
    state, DDP hooks and accelerate still hold the same objects); only their storage moves, so
    call it once, before training. Not for sharded models (FSDP, DTensor). `shared=True` puts the
    buffer where engines on this machine can read it (weight_sync.trainer.shared_memory: /dev/shm on the CPU, a
    CUDA IPC handle on a GPU), for pushes with no process group. Returns the buffer."""
    root = unwrap_model(model)
    if _fsdp1_root(root) is not None:
        raise ValueError("flatten_parameters is for unsharded models (FSDP shards its own flat parameters)")
    params = {clean_name(n): p for n, p in root.named_parameters()}
    with named_weights(root) as named:
        if any(hasattr(t, "full_tensor") for _, t in named):
            raise ValueError("flatten_parameters is for unsharded models (found a DTensor)")
        devices = {t.device for _, t in named}
        if len(devices) != 1:
            raise ValueError(f"parameters live on several devices: {sorted(map(str, devices))}")
        offsets, layout, _ = plan_layout([t.numel() * t.element_size() for _, t in named], 1)
        device = devices.pop()
        if shared:
            from weight_sync.trainer.shared_memory import shared_buffer

            buf = shared_buffer(layout + ALIGNMENT, device)
        else:
            buf = torch.empty(layout + ALIGNMENT, dtype=torch.uint8, device=device)
        shift = -buf.data_ptr() % ALIGNMENT  # offsets are relative: align the start like a staging buffer
        flat = buf[shift: shift + layout]
        with torch.no_grad():
            for (name, t), off in zip(named, offsets):
                p = params[name]
                view = flat[off: off + t.numel() * t.element_size()].view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view
    return flat


def _fused_experts(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Per-expert names stacked into transformers 5's fused tensors (the pairs as they are without any)."""
    from engine.models.expert_names import expert_part, fuse_checkpoint

    if not any(expert_part(n) is not None for n, _ in named):
        return named
    return list(fuse_checkpoint(dict(named)).items())


def _checked(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for n, _ in named:
        if n in seen:
            raise ValueError(f"two different tensors are named {n!r} (after removing wrapper prefixes)")
        seen.add(n)
    return named


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to its full value (a collective of the trainer's group), else itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
