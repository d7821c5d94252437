"""Delta pushes (issue 38): a push that carries only the elements that changed since the weights
every receiver holds, which each receiver applies to a copy of the weights it serves, giving bit
for bit what a full push of the same weights would (weight_sync/common/delta.py compares and encodes).

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
weights it last sent, in the wire dtype. Here: the payload's layout and its checks, which both
sides share; the trainer's kept weights and encoding are weight_sync/trainer/delta_encode.py, the
receiver's apply weight_sync/engine_side/delta_apply.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from weight_sync.common.manifest import DeltaPart, Manifest, TensorSpec, plan_layout

POSITIONS, BITMAP, VALUES = "#positions", "#bitmap", "#values"
KINDS = ("indices", "bitmap", "full")

# The first problem of a receiver that cannot take a delta because it does not hold its base: the
# trainer then pushes the full weights (weight_sync/trainer/push.py). Compared by identity, as NEEDS_BASE.
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
