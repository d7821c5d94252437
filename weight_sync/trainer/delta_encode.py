"""A delta push on the trainer (weight_sync/common/delta_push.py): the weights it last sent, kept
as the next delta's base, and the changes from them encoded as a payload."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from weight_sync.common import delta as D
from weight_sync.common.delta_push import BITMAP, POSITIONS, VALUES
from weight_sync.common.digest import Digest
from weight_sync.common.host_memory import alloc
from weight_sync.common.manifest import DeltaPart
from weight_sync.trainer.weights import full


@dataclass
class KeptWeights:
    """What the trainer last sent, in the wire dtype, on the weights' own device (on a GPU trainer
    that is device memory: 2 bytes per parameter for bf16, half an fp32 model): the base of its
    next delta. Only a push every receiver committed makes it the base (`version`, `digest`)."""

    version: int
    digest: int
    specs: list  # (name, dtype, shape) of each tensor, in push order
    tensors: dict[str, torch.Tensor]


@dataclass
class EncodedDelta:
    pairs: list[tuple[str, torch.Tensor]]  # the payload, in manifest order
    parts: list[DeltaPart]
    digest: int  # of the weights once applied
    deltas: dict[str, D.Delta]  # what to apply to the kept weights once the push committed
    full_bytes: int  # what the full push would carry
    seconds: float = 0.0  # encoding it (casting, comparing, gathering the changes, the digest)


def encode_delta(named: Iterable[tuple[str, torch.Tensor]], to_wire: Callable[[torch.Tensor], torch.Tensor],
                 kept: KeptWeights) -> EncodedDelta:
    """The changes from `kept` to the new weights (`named`, in push order; `to_wire` casts one to
    the wire dtype, a tensor at a time so no second copy of the model is made)."""
    pairs, parts, deltas, digest, full_bytes = [], [], {}, Digest(), 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, (name, t) in enumerate(named):
            new = to_wire(t)
            digest.add(new)
            full_bytes += new.numel() * new.element_size()
            d = D.encode(kept.tensors[name], new)
            if d.values.numel() == 0:
                continue
            parts.append(DeltaPart(i, d.kind, d.values.numel()))
            deltas[name] = d
            if d.kind == "indices":
                pairs.append((name + POSITIONS, d.positions))
            elif d.kind == "bitmap":
                pairs.append((name + BITMAP, d.positions))
            pairs.append((name + VALUES, d.values))
    return EncodedDelta(pairs, parts, digest.value(), deltas, full_bytes, time.perf_counter() - t0)


def advance(kept: KeptWeights, enc: EncodedDelta, version: int) -> None:
    """The delta committed everywhere: the kept weights become what it made (O(changed elements))."""
    with torch.no_grad():
        for name, d in enc.deltas.items():
            D.apply(kept.tensors[name].view(-1), d)
    kept.version, kept.digest = version, enc.digest


def keeps_base(keep_sent: bool | None, specs: list) -> bool:
    """Whether the trainer keeps what a push sent as the next delta's base: as told, or (None)
    when the push travels in 2-byte floats (in fp32 nearly every element changes every step)."""
    if keep_sent is not None:
        return keep_sent
    return all(d not in ("float32", "float64") for _, d, _ in specs)


def kept_weights(version: int, digest: int, specs: list, named, wire_dtype: Callable,
                 previous: KeptWeights | None = None) -> KeptWeights:
    """A copy of what a push sent (`named`), each tensor in its wire dtype, on its own device. On
    the CPU the copies lie in one buffer whose pages are provided in one go, and a `previous` base
    of the same layout is written over instead (each tensor copied to fresh memory took 7 s at 1.7B
    on a 2-core machine, most of it page faults)."""
    named = list(named)
    with torch.no_grad():
        if previous is not None and previous.specs == specs:
            for n, t in named:
                previous.tensors[n].copy_(full(t))
            return KeptWeights(version, digest, specs, previous.tensors)
        if any(full(t).device.type != "cpu" for _, t in named):
            tensors = {n: full(t).to(wire_dtype(t), copy=True) for n, t in named}
            return KeptWeights(version, digest, specs, tensors)
        return KeptWeights(version, digest, specs, _in_one_buffer(named, wire_dtype))


def _in_one_buffer(named: list, wire_dtype: Callable) -> dict[str, torch.Tensor]:
    dtypes = [wire_dtype(t) for _, t in named]
    sizes = [-(-t.numel() * d.itemsize // 64) * 64 for (_, t), d in zip(named, dtypes)]
    buf = alloc(sum(sizes), torch.device("cpu"))
    out, offset = {}, 0
    for (n, t), d, size in zip(named, dtypes, sizes):
        view = buf[offset:offset + t.numel() * d.itemsize].view(d).view(t.shape)
        out[n] = view.copy_(full(t))
        offset += size
    return out
