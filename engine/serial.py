"""msgpack (msgspec) encoding with tensors as (dtype, shape, raw frame): a message is a list of
ZMQ frames, the first the msgpack body, the rest tensor bytes sent without a copy. No pickle."""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import numpy as np

TENSOR_EXT = 1
# Tensor dtypes that travel, by torch's names. torch is imported only where a tensor is met: the
# sidecar's front end, which sends none, runs without it (an object cannot be a tensor before
# torch was imported).
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


class Encoder:
    def __init__(self):
        self._frames: list[Any] = []
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)

    def _hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous().cpu()
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise TypeError(f"cannot send tensors of dtype {t.dtype}")
            self._frames.append(t.view(-1).view(torch.uint8).numpy() if t.numel() else b"")
            header = msgspec.msgpack.encode((dtype, list(t.shape), len(self._frames)))
            return msgspec.msgpack.Ext(TENSOR_EXT, header)
        if isinstance(obj, (np.integer, np.floating)):
            return obj.item()
        raise TypeError(f"cannot serialise {type(obj).__name__}")

    def encode(self, obj: Any) -> list[Any]:
        self._frames = []
        body = self._enc.encode(obj)
        frames, self._frames = [body, *self._frames], []
        return frames


class Decoder:
    def __init__(self, typ: Any = Any):
        self._frames: list[Any] = []
        self._dec = msgspec.msgpack.Decoder(typ, ext_hook=self._hook)

    def _hook(self, code: int, data: memoryview) -> Any:
        if code != TENSOR_EXT:
            raise ValueError(f"unknown msgpack extension {code}")
        dtype, shape, idx = msgspec.msgpack.decode(data)
        if dtype not in _DTYPES or not 0 < idx < len(self._frames):
            raise ValueError("malformed tensor header")
        import torch

        buf = self._frames[idx]
        if len(buf) == 0:
            return torch.empty(shape, dtype=getattr(torch, dtype))
        # copy out of the ZMQ frame so the tensor owns writable memory
        return torch.frombuffer(bytearray(buf), dtype=getattr(torch, dtype)).reshape(shape)

    def decode(self, frames: list[Any]) -> Any:
        """Raises msgspec.DecodeError / ValueError on a malformed message."""
        if not frames:
            raise ValueError("empty message")
        self._frames = frames
        try:
            return self._dec.decode(frames[0])
        finally:
            self._frames = []
