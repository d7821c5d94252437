"""Delta pushes (issue 38): a push that carries only the elements that changed since the weights
every receiver holds, which each receiver applies to a copy of the weights it serves, giving bit
for bit what a full push of the same weights would (weight_sync/delta.py compares and encodes).

It is a full push's protocol throughout: the manifest vote before any byte (a receiver whose
weights are not the delta's base refuses there, `NEEDS_FULL`, and the trainer sends the full
weights instead), staging, the commit vote on the digest of the applied result (a delta patched
onto the wrong weights cannot commit), all or nothing. The changes travel as an ordinary
manifest's tensors, so whatever moves a manifest's buckets (the group's broadcast, the chain
across hosts) moves them unchanged:

    <name>#positions int32 [k]        <name>#values [k]    "indices": k changed elements
    <name>#bitmap uint8 [ceil(n / 8)]  <name>#values [k]    "bitmap": one bit per element
                                       <name>#values [n]    "full": most of it changed

Tensors with no change send nothing. The receiver's staging holds the whole result (the weights
it will serve, the staging a full push would take) plus the small payload; the trainer keeps the
weights it last sent, in the wire dtype (`KeptWeights`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from weight_sync import delta as D
from weight_sync.digest import Digest
from weight_sync.manifest import DTYPES, DeltaPart, Manifest, TensorSpec, plan_layout
from weight_sync.targets import views

POSITIONS, BITMAP, VALUES = "#positions", "#bitmap", "#values"
KINDS = ("indices", "bitmap", "full")

# The first problem of a receiver that cannot take a delta because it does not hold its base: the
# trainer then pushes the full weights (weight_sync/push.py). Compared by identity, as NEEDS_BASE.
NEEDS_FULL = "this worker does not hold the delta's base weights: push the full weights"


# -- the payload's layout --------------------------------------------------------------------
def payload_specs(full: Sequence[TensorSpec], parts: Sequence[DeltaPart]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of each payload tensor the parts imply, in order."""
    out = []
    for p in parts:
        t = full[p.tensor]
        if p.kind == "indices":
            out.append((t.name + POSITIONS, "int32", (p.count,)))
        elif p.kind == "bitmap":
            out.append((t.name + BITMAP, "uint8", ((t.numel + 7) // 8,)))
        out.append((t.name + VALUES, t.dtype, (p.count,)))
    return out


def full_manifest(m: Manifest) -> Manifest:
    """The full push a delta manifest stands for: its version and push id, the result's layout."""
    d = m.delta
    _, _, buckets = plan_layout([t.nbytes for t in d.full], m.bucket_bytes, m.alignment)
    return Manifest(version=m.version, tensors=list(d.full), buckets=buckets,
                    total_bytes=sum(t.nbytes for t in d.full), layout_bytes=d.full_bytes,
                    bucket_bytes=m.bucket_bytes, alignment=m.alignment, push_id=m.push_id)


def check_delta(m: Manifest) -> list[str]:
    """A delta manifest's own consistency: its parts name tensors of the result in order, with
    counts that fit them, and its tensors are exactly the payload those parts imply."""
    d = m.delta
    if m.adapter is not None:
        return ["a push cannot be an adapter and a delta at once"]
    problems, last = [], -1
    for p in d.parts:
        if not last < p.tensor < len(d.full):
            problems.append(f"delta part for tensor {p.tensor}: out of order or outside the {len(d.full)} tensors")
            break
        last = p.tensor
        t = d.full[p.tensor]
        if p.kind not in KINDS:
            problems.append(f"{t.name}: unknown delta kind {p.kind!r}")
        elif not 0 < p.count <= t.numel or (p.kind == "full" and p.count != t.numel):
            problems.append(f"{t.name}: {p.count} changed values for a tensor of {t.numel} elements ({p.kind})")
    if problems:
        return problems
    if payload_specs(d.full, d.parts) != [(t.name, t.dtype, tuple(t.shape)) for t in m.tensors]:
        problems.append("the delta's tensors are not the payload its parts describe")
    return problems


# -- the receiver: the result from its base and the payload -------------------------------------
def fill_base(full: Manifest, result: torch.Tensor, base: Sequence[torch.Tensor]) -> None:
    """The weights the receiver serves, laid into `result` as the full push would lay them (cast
    to the wire dtype: exact when they came in it)."""
    with torch.no_grad():
        for (_, view), t in zip(views(full, result), base):
            view.copy_(t)


def apply_payload(m: Manifest, full: Manifest, payload: torch.Tensor, result: torch.Tensor) -> None:
    """Every part of delta manifest `m` (its bytes in `payload`) written into `result`. Raises
    ValueError when a part does not fit (positions outside its tensor, say)."""
    sent = {t.name: payload[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]) for t in m.tensors}
    empty = torch.empty(0, dtype=torch.uint8, device=payload.device)
    for p in m.delta.parts:
        spec = full.tensors[p.tensor]
        dst = result[spec.offset:spec.offset + spec.nbytes].view(DTYPES[spec.dtype])
        positions = sent.get(spec.name + POSITIONS, sent.get(spec.name + BITMAP, empty))
        try:
            D.apply(dst, D.Delta(p.kind, positions, sent[spec.name + VALUES]))
        except ValueError as e:
            raise ValueError(f"{spec.name}: {e}") from None


# -- the trainer: what it last sent, and the delta against it -----------------------------------
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
