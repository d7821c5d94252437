"""Sources of a push's bytes other than the group, filling the same staging buffer
(weight_sync/engine_side/receive.py): a trainer's shared buffer on this host (the engine's end of
weight_sync/trainer/shared_memory.py) and a push directory (weight_sync/common/push_dir.py)."""

from __future__ import annotations

import os

import torch

from weight_sync.common.manifest import DTYPES, Manifest
from weight_sync.common.shm_names import SHM_DIR, SHM_PREFIX
from weight_sync.engine_side.staging_memory import st_dtype

_HANDLE_KEYS = ("kind", "path", "handle", "size", "offset", "nbytes", "storage_offset", "device")


class SharedSource:
    """The trainer's shared buffer, mapped once and kept while the handle stays the same (a
    training run pushes from one buffer): mapping it afresh costs a page fault per page."""

    def __init__(self):
        self.key: tuple | None = None
        self.buf: torch.Tensor | None = None

    def open(self, handle: dict, m: Manifest) -> tuple[torch.Tensor | None, list[str]]:
        """The mapped buffer, or the problems that keep it from being used for `m`."""
        key = tuple(sorted((k, v) for k, v in handle.items() if k in _HANDLE_KEYS))
        try:
            if self.key != key:
                self.drop()
                self.buf, self.key = open_weights(handle), key
        except Exception as e:
            return None, [f"cannot map the trainer's weights: {type(e).__name__}: {e}"]
        if self.buf.numel() < m.layout_bytes:
            return None, [f"the shared buffer holds {self.buf.numel()} bytes, the manifest {m.layout_bytes}"]
        return self.buf[:m.layout_bytes], []

    def drop(self) -> None:
        self.key, self.buf = None, None


def fill_from_file(m: Manifest, staging: torch.Tensor, path: str) -> None:
    """Every tensor of the push directory `path` into staging; raises ValueError if the file does
    not hold exactly the manifest's tensors."""
    from safetensors import safe_open

    from weight_sync.common.push_dir import MANIFEST_FILE, WEIGHTS_FILE, read_raw

    raw = read_raw(path, m)
    if raw is not None:  # an engine's host copy: the push's layout as it lies
        staging[:m.layout_bytes].copy_(raw)
        return
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"no {WEIGHTS_FILE} in {path} (a push directory holds {WEIGHTS_FILE} and {MANIFEST_FILE})")
    with safe_open(file, framework="pt", device="cpu") as f:
        keys = set(f.keys())
        if keys != set(m.names):
            extra, lacking = sorted(keys - set(m.names)), sorted(set(m.names) - keys)
            raise ValueError(f"{WEIGHTS_FILE} does not match the manifest: extra {extra[:8]}, lacking {lacking[:8]}")
        for t in m.tensors:
            sl = f.get_slice(t.name)
            shape, dtype = tuple(sl.get_shape()), st_dtype(sl.get_dtype())
            if shape != tuple(t.shape) or dtype != t.dtype:
                raise ValueError(f"{t.name}: file has {dtype} {list(shape)}, manifest says {t.dtype} {list(t.shape)}")
            if t.nbytes:
                staging[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape).copy_(f.get_tensor(t.name))


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
