"""Sources of a push's bytes other than the group, filling the same staging buffer
(weight_sync/receive.py): a trainer's shared buffer on this host (weight_sync/shared.py) and a
push directory (weight_sync/files.py)."""

from __future__ import annotations

import os

import torch

from weight_sync.manifest import DTYPES, Manifest
from weight_sync.staging_memory import st_dtype

_HANDLE_KEYS = ("kind", "path", "handle", "size", "offset", "nbytes", "storage_offset", "device")


class SharedSource:
    """The trainer's shared buffer, mapped once and kept while the handle stays the same (a
    training run pushes from one buffer): mapping it afresh costs a page fault per page."""

    def __init__(self):
        self.key: tuple | None = None
        self.buf: torch.Tensor | None = None

    def open(self, handle: dict, m: Manifest) -> tuple[torch.Tensor | None, list[str]]:
        """The mapped buffer, or the problems that keep it from being used for `m`."""
        from weight_sync.shared import open_weights

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

    from weight_sync.files import MANIFEST_FILE, WEIGHTS_FILE

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
