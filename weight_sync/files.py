"""The file fallback, for when no process group can be formed: the trainer writes a push as
safetensors plus its manifest into a directory (on a shared filesystem, or under /dev/shm on one
host); each worker validates it and loads it with `load_weights_from_path` (all or nothing).

A push directory holds `weights.safetensors` and `manifest.json`. Both are written under temporary
names and renamed into place, the manifest last, so a reader never sees a half-written push: a
directory without `manifest.json` is not a push (yet). Write each version to its own directory
(e.g. `/dev/shm/ws/v{k}`) and delete old ones once every engine has loaded them.

Memory: safetensors writes from a dict of every tensor. CPU parameters are referenced, not
copied; DTensors and CUDA tensors are gathered / copied to host memory first (one full host copy
of the model while writing).
"""

from __future__ import annotations

import os

import torch

from weight_sync.manifest import Manifest, build_manifest, dtype_name
from weight_sync.sender import DEFAULT_BUCKET_BYTES
from weight_sync.trainer_weights import full, named_weights

WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"


def write_safetensors(weights, path: str | os.PathLike, version: int, dtype: torch.dtype | None = None) -> Manifest:
    """Write a push of `weights` (module or (name, tensor) pairs, as WeightSender takes) to the
    directory `path`; returns its manifest (also saved as manifest.json)."""
    with named_weights(weights) as named:
        tensors = {}
        for name, t in named:
            t = full(t)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name] = t.detach().to("cpu").contiguous()
    return write_tensors(tensors, path, version)


def host_snapshot(named) -> tuple[dict[str, torch.Tensor], object]:
    """A copy of (name, tensor) pairs in host memory, for writing in the background while the
    engine goes on (and a later push changes its weights). On CUDA: pinned buffers filled on a
    stream of their own, so the engine's thread only queues the copies; returns the event that
    marks them done (None on CPU, where the copy is made here)."""
    cuda = [t for _, t in named if t.is_cuda]
    if not cuda:
        return {n: t.detach().clone() for n, t in named}, None
    device = cuda[0].device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))  # after the commit that made these weights
    out = {}
    with torch.cuda.stream(side):
        for n, t in named:
            out[n] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach(), non_blocking=True)
            t.record_stream(side)
    done = torch.cuda.Event()
    done.record(side)
    return out, done


def write_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, version: int, ready=None) -> Manifest:
    """Write host tensors as a push directory (weights, then manifest.json: a reader that sees
    the manifest sees a whole push). `ready`: an event to wait for first (host_snapshot's)."""
    from safetensors.torch import save_file

    if ready is not None:
        ready.synchronize()
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    manifest = build_manifest([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()], version,
                              DEFAULT_BUCKET_BYTES)
    tmp = os.path.join(path, f".{WEIGHTS_FILE}.tmp")
    save_file(tensors, tmp, metadata={"version": str(int(version)), "push_id": manifest.push_id})
    os.replace(tmp, os.path.join(path, WEIGHTS_FILE))
    tmp = os.path.join(path, f".{MANIFEST_FILE}.tmp")
    with open(tmp, "wb") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST_FILE))
    return manifest


def read_manifest(path: str | os.PathLike) -> Manifest:
    file = os.path.join(os.fspath(path), MANIFEST_FILE)
    try:
        with open(file, "rb") as f:
            return Manifest.from_wire(f.read().decode())
    except FileNotFoundError:
        raise ValueError(f"{path} holds no complete push: {MANIFEST_FILE} is missing") from None


def read_tensors(path: str | os.PathLike) -> list[tuple[str, torch.Tensor]]:
    """A push directory's tensors as (name, tensor) pairs in its manifest's order: what a sidecar
    sends on from its host copy (rollout.peer_send)."""
    from safetensors import safe_open

    m = read_manifest(path)
    with safe_open(os.path.join(os.fspath(path), WEIGHTS_FILE), framework="pt", device="cpu") as f:
        return [(t.name, f.get_tensor(t.name)) for t in m.tensors]
