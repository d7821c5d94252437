"""Delta encoding of a tensor's new values against the values a receiver already holds (issue 38):
only the elements whose bits changed travel, as their positions and their new values.

Compared bit for bit in the wire dtype (a bf16 engine's weights, as the trainer last sent them):
an element whose optimizer update is under half a bf16 ulp rounds to the same bits and does not
travel; -0.0 vs 0.0 and NaN payloads count as changes, so applying a delta gives exactly the
bits a full push would.

Positions go as one of two encodings, whichever is smaller for the tensor:
- "indices": int32 flat positions, 4 bytes per changed element;
- "bitmap": one bit per element, n/8 bytes whatever changed.
With k of n elements changed and values of `itemsize` bytes, indices cost 4k and the bitmap n/8:
indices win below 1/32 of the elements changed (3.1%), the bitmap above. Values cost k * itemsize
either way; past (itemsize * n - n / 8) / itemsize elements the full tensor is smaller, and goes.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

INDEX_BYTES = 4  # int32 positions: a tensor of up to 2**31 elements
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` flat, viewed as integers of its width: equal bits compare equal (NaN too), -0 != 0."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, ascending) where `new`'s bits differ from `old`'s."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"a delta needs the same shape and dtype: {tuple(old.shape)} {old.dtype} vs "
                         f"{tuple(new.shape)} {new.dtype}")
    return (_bits(old) != _bits(new)).nonzero().reshape(-1)


def encoded_bytes(n: int, k: int, itemsize: int) -> dict[str, int]:
    """What each way of sending k changed elements of n costs, in bytes."""
    values = k * itemsize
    return {"indices": INDEX_BYTES * k + values, "bitmap": (n + 7) // 8 + values, "full": n * itemsize}


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bits, 8 per byte, least significant first (uint8, ceil(n / 8) bytes)."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8)
    padded[:n] = mask.reshape(-1)
    return (padded.view(-1, 8) * _WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_bits' inverse: the first n bits as a bool vector."""
    return ((packed.reshape(-1, 1) & _WEIGHTS) != 0).reshape(-1)[:n]


@dataclass
class Delta:
    """One tensor's change: `kind` "indices" (positions: int32), "bitmap" (positions: packed bits)
    or "full" (values: the whole tensor, positions empty); `values`: the new values, in the
    order of their positions."""

    kind: str
    positions: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.positions.numel() * self.positions.element_size() + self.values.numel() * self.values.element_size()


@functools.cache
def _native() -> dict | None:
    """engine/kernels/native/delta_bits.c's functions (2-byte values), or None where the kernels do not build."""
    from engine.kernels import native_kernels

    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fns = {"encode": native_kernels.function("delta_bits", "delta_encode_u16", (ptr, ptr, i64, ptr, ptr), i64),
           "count": native_kernels.function("delta_bits", "bitmap_count", (ptr, i64), i64),
           "apply": native_kernels.function("delta_bits", "delta_apply_u16", (ptr, i64, ptr, ptr), None),
           "positions": native_kernels.function("delta_bits", "bitmap_positions", (ptr, i64, ptr), i64)}
    return fns if all(fns.values()) else None


def _fast(*tensors: torch.Tensor) -> dict | None:
    """The one-pass kernels, for contiguous 2-byte CPU tensors."""
    if all(t.device.type == "cpu" and t.element_size() == 2 and t.is_contiguous() for t in tensors):
        return _native()
    return None


def encode(old: torch.Tensor, new: torch.Tensor) -> Delta:
    """`new` as a change to `old` (same shape and dtype), in the smallest of the three kinds."""
    if old.shape == new.shape and old.dtype == new.dtype and (native := _fast(old, new)):
        return _encode_native(native, old, new)
    pos = changed_positions(old, new)
    n, k = new.numel(), pos.numel()
    cost = encoded_bytes(n, k, new.element_size())
    kind = min(cost, key=lambda c: (cost[c], c != "full"))  # a tie goes to the full tensor: no positions
    flat = new.reshape(-1)
    if kind == "full":
        return Delta("full", torch.empty(0, dtype=torch.uint8), flat.clone())
    if kind == "indices":
        return Delta("indices", pos.to(torch.int32), flat[pos])
    mask = torch.zeros(n, dtype=torch.bool)
    mask[pos] = True
    return Delta("bitmap", pack_bits(mask), flat[pos])


def _encode_native(native: dict, old: torch.Tensor, new: torch.Tensor) -> Delta:
    """`encode` in one pass (engine/kernels/native/delta_bits.c): the same Delta, bit for bit."""
    flat, n = new.reshape(-1), new.numel()
    bitmap = torch.empty((n + 7) // 8, dtype=torch.uint8)
    values = torch.empty(n, dtype=new.dtype)
    k = native["encode"](old.data_ptr(), new.data_ptr(), n, bitmap.data_ptr(), values.data_ptr())
    cost = encoded_bytes(n, k, new.element_size())
    kind = min(cost, key=lambda c: (cost[c], c != "full"))
    if kind == "full":
        return Delta("full", torch.empty(0, dtype=torch.uint8), flat.clone())
    if kind == "indices":
        pos = torch.empty(k, dtype=torch.int32)
        native["positions"](bitmap.data_ptr(), n, pos.data_ptr())
        return Delta("indices", pos, values[:k].clone())
    return Delta("bitmap", bitmap, values[:k].clone())


def apply(base: torch.Tensor, delta: Delta) -> None:
    """Writes `delta` into `base` (contiguous, in place): afterwards its bits equal the tensor it
    was encoded from. Raises ValueError on a delta that does not fit `base`."""
    flat = base.view(-1)
    n = flat.numel()
    if delta.values.dtype != base.dtype:
        raise ValueError(f"delta values are {delta.values.dtype}, the tensor is {base.dtype}")
    if delta.kind == "full":
        if delta.values.numel() != n:
            raise ValueError(f"a full delta of {delta.values.numel()} elements for a tensor of {n}")
        flat.copy_(delta.values)
        return
    if delta.kind == "indices":
        pos = delta.positions.to(torch.int64)
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= n):
            raise ValueError(f"delta positions outside a tensor of {n} elements")
    elif delta.kind == "bitmap":
        if delta.positions.numel() != (n + 7) // 8:
            raise ValueError(f"a bitmap of {delta.positions.numel()} bytes for a tensor of {n} elements")
        bits, values = delta.positions.contiguous(), delta.values.contiguous()
        if native := _fast(flat, values):
            k = native["count"](bits.data_ptr(), n)
            if k != values.numel():  # checked before any write
                raise ValueError(f"{k} positions for {values.numel()} values")
            native["apply"](flat.data_ptr(), n, bits.data_ptr(), values.data_ptr())
            return
        pos = unpack_bits(delta.positions, n).nonzero().reshape(-1)
    else:
        raise ValueError(f"unknown delta kind {delta.kind!r}")
    if pos.numel() != delta.values.numel():
        raise ValueError(f"{pos.numel()} positions for {delta.values.numel()} values")
    flat[pos] = delta.values
