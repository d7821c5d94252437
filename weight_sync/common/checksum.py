"""One definition of a weights checksum, computed the same way by the trainer and the engine.

`weights_checksum(named_tensors)`: SHA-256 over, for each tensor in name order, its name, dtype,
shape and raw bytes. A tensor that shares its storage with one seen earlier in the iteration
(a tied weight: `lm_head.weight` after `model.embed_tokens.weight`) is skipped, so a module's
`named_parameters()` (which already skips tied duplicates) and its `state_dict().items()` (which
does not) give the same checksum. Values are hashed in their own dtype: an engine serving bf16
from an fp32 push has a different checksum than the trainer, by design.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def storage_key(t: torch.Tensor):
    """Identity of a tensor's memory: equal for the same weight seen under two names."""
    local = getattr(t, "_local_tensor", None)  # DTensor: its local shard identifies it
    if local is not None:
        t = local
    if t.is_meta or t.numel() == 0:
        return ("id", id(t))
    # data_ptr() is the storage's address plus the offset: with shape, stride and dtype it names
    # the view (and reads 4x faster than untyped_storage(); a push walks every parameter)
    return (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype)


def dedup_tied(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Keep the first name of every distinct tensor, in iteration order."""
    seen: set = set()
    out = []
    for name, t in named:
        key = storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    t = t.contiguous().cpu().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hex SHA-256 over every distinct tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(dedup_tied(named), key=lambda kv: kv[0]):
        dtype = str(t.dtype).removeprefix("torch.")
        h.update(f"{name}\0{dtype}\0{list(t.shape)}\0".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Hex SHA-256 of each distinct tensor's bytes, by name: vLLM's `compute_tensor_digests`
    (its /weight_checker), so two snapshots say which weights differ, not only that some do."""
    return {name: hashlib.sha256(tensor_bytes(t)).hexdigest() for name, t in dedup_tied(named)}
