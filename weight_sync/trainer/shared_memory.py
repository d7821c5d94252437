"""Pushes between a trainer and engines on one machine with no process group: the engine reads the
trainer's flattened weights straight from memory they share, copies them into its staging
buffer and commits as any push (same manifest validation, never half-applied). On a GPU the
memory is a CUDA IPC handle (trainer and engine colocated on one GPU, where NCCL cannot place
two ranks); on the CPU it is a file under /dev/shm. The handle crosses processes as msgpack
fields (bytes, ints, a path), never pickle.

The trainer's weights must lie in one buffer laid out as the push's manifest lays them out:
`flatten_parameters(model, shared=True)` puts them there once, before training. This is the
trainer's end: the buffer and its handle. The engine's end (weight_sync/engine_side/staging_sources.py)
maps the buffer once and keeps the mapping while the handle stays the same; it only ever copies out
of it, and opens only files made here (under /dev/shm, with SHM_PREFIX).
"""

from __future__ import annotations

import atexit
import os

import torch

from weight_sync.common.manifest import Manifest, dtype_name
from weight_sync.common.shm_names import SHM_DIR, SHM_PREFIX, _remove, owned_name, sweep_orphans

_SHM_FILES: dict[int, str] = {}  # storage data_ptr -> the /dev/shm file behind it (this process's)
_CUDA_HANDLES: dict[tuple, dict] = {}  # (data_ptr, nbytes) of a storage -> its CUDA IPC handle, shared once


def shared_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer other processes of this machine can map: a /dev/shm file on the CPU (removed
    at exit), ordinary device memory on CUDA (shared through IPC handles)."""
    if device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    sweep_orphans((SHM_PREFIX,))
    path = os.path.join(SHM_DIR, owned_name(SHM_PREFIX))
    buf = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    _SHM_FILES[buf.untyped_storage().data_ptr()] = path
    atexit.register(_remove, path)
    return buf


def export_weights(manifest: Manifest, named: list[tuple[str, torch.Tensor]]) -> dict:
    """The handle of the buffer holding the weights `named`, which must lie in it exactly as
    `manifest` lays them out (flatten_parameters(model, shared=True)). Raises ValueError."""
    live = [(spec, t) for spec, (_, t) in zip(manifest.tensors, named) if spec.nbytes]
    if not live:
        raise ValueError("nothing to push")
    spec0, t0 = live[0]
    base = t0.data_ptr() - spec0.offset
    storage = t0.untyped_storage()
    for spec, t in live:
        if (hasattr(t, "full_tensor") or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.data_ptr() != base + spec.offset or not t.is_contiguous() or dtype_name(t.dtype) != spec.dtype):
            raise ValueError(f"{spec.name} does not lie in one buffer at the push's layout: call "
                             "weight_sync.flatten_parameters(model, shared=True) once, before training")
    offset = base - storage.data_ptr()
    if storage.device.type == "cuda":
        # The engine copies out of this buffer as soon as it has the handle, on its own stream:
        # every write the trainer queued (its optimizer step) must be done first, at every push
        # (the IPC event below orders only the engine's first mapping, which it then keeps).
        torch.cuda.synchronize(storage.device)
        key = (storage.data_ptr(), storage.nbytes())
        if key not in _CUDA_HANDLES:  # each _share_cuda_ call takes an IPC reference: once per buffer
            (device, handle, size, storage_offset, rc_handle, rc_offset, event_handle,
             event_sync) = storage._share_cuda_()
            _CUDA_HANDLES[key] = {
                "kind": "cuda", "device": int(device), "handle": bytes(handle), "size": int(size),
                "storage_offset": int(storage_offset), "ref_counter_handle": bytes(rc_handle),
                "ref_counter_offset": int(rc_offset), "event_handle": bytes(event_handle or b""),
                "event_sync_required": bool(event_sync),
                "gpu_uuid": str(torch.cuda.get_device_properties(storage.device).uuid)}
        return {**_CUDA_HANDLES[key], "offset": int(offset), "nbytes": manifest.layout_bytes}
    path = _SHM_FILES.get(storage.data_ptr())
    if path is None:
        raise ValueError("the weights are not in shared memory: call weight_sync.flatten_parameters(model, "
                         "shared=True) once, before training")
    return {"kind": "shm", "path": path, "size": int(storage.nbytes()), "offset": int(offset),
            "nbytes": manifest.layout_bytes}

