"""Pushes between a trainer and engines on one machine with no process group: the engine reads the
trainer's flattened weights straight from memory they share, copies them into its staging
buffer and commits as any push (same manifest validation, never half-applied). On a GPU the
memory is a CUDA IPC handle (trainer and engine colocated on one GPU, where NCCL cannot place
two ranks); on the CPU it is a file under /dev/shm. The handle crosses processes as msgpack
fields (bytes, ints, a path), never pickle.

The trainer's weights must lie in one buffer laid out as the push's manifest lays them out:
`flatten_parameters(model, shared=True)` puts them there once, before training. Engines map the
buffer once and keep the mapping while the handle stays the same; they only ever copy out of it,
and only files this module made (under /dev/shm, with its prefix) are opened.
"""

from __future__ import annotations

import atexit
import os

import torch

from weight_sync.manifest import Manifest, dtype_name
from weight_sync.shm_names import SHM_DIR, _remove, owned_name, sweep_orphans

SHM_PREFIX = "rollout-weights-"
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


def open_weights(handle: dict) -> torch.Tensor:
    """The engine's side: the trainer's buffer as a uint8 tensor of `handle["nbytes"]`, to read."""
    offset, nbytes = int(handle["offset"]), int(handle["nbytes"])
    if handle["kind"] == "shm":
        path = os.path.realpath(str(handle["path"]))
        if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(SHM_PREFIX):
            raise ValueError(f"refusing to map {path}: not a shared weight buffer")
        size = int(handle["size"])
        if os.path.getsize(path) < size or offset + nbytes > size:
            raise ValueError(f"{path} holds {os.path.getsize(path)} bytes, the handle claims {offset + nbytes}")
        # MAP_SHARED, so a mapping kept between pushes sees the trainer's later writes; the engine
        # only ever reads it (receive_weights_shared copies out of it)
        buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return buf[offset:offset + nbytes]
    if handle["kind"] == "cuda":
        torch.cuda._lazy_init()
        device = handle["device"]
        if handle.get("gpu_uuid"):  # the trainer's index may name another GPU here (CUDA_VISIBLE_DEVICES)
            uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
            device = local_cuda_index(handle["gpu_uuid"], uuids)
        storage = torch.UntypedStorage._new_shared_cuda(
            device, handle["handle"], handle["size"], handle["storage_offset"],
            handle["ref_counter_handle"], handle["ref_counter_offset"], handle["event_handle"] or None,
            handle["event_sync_required"])
        if offset + nbytes > storage.nbytes():
            raise ValueError(f"the shared CUDA buffer holds {storage.nbytes()} bytes, the handle claims "
                             f"{offset + nbytes}")
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, offset, (nbytes,))
    raise ValueError(f"unknown shared-memory kind {handle.get('kind')!r}")


def local_cuda_index(gpu_uuid: str, visible_uuids: list[str]) -> int:
    """This process's index of the GPU whose UUID is `gpu_uuid` (processes with different
    CUDA_VISIBLE_DEVICES, or containers, number one GPU differently). Raises ValueError when
    the trainer's GPU is not visible here: a colocated push needs the same GPU."""
    if gpu_uuid not in visible_uuids:
        raise ValueError(f"the trainer's GPU ({gpu_uuid}) is not one this engine sees ({', '.join(visible_uuids) or 'none'}):"
                         " a shared push needs trainer and engine on one GPU; push over the group instead")
    return visible_uuids.index(gpu_uuid)
