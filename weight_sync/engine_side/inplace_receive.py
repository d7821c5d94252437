"""The in-place receive (weight_sync/engine_side/receive.py `PushReceiver.receive_inplace`): a
full push's buckets as `(name, tensor)` pairs, each bucket received into a buffer of its own and handed
on while it arrives, for an engine with no room for a staging copy of its weights. The sidecar
uses it only then (`staging_room` says no, or the push needs more than
`--staging-memory-limit-mb`), with the engines paused for the whole transfer.

The price of the memory saved: before the commit vote the weights already hold part of the new
version. A transfer that fails after the first bucket landed leaves the weights torn; the worker
then reports itself unhealthy and the sidecar restarts its engine, which catches up with the last
committed weights (host copy, sibling, or the next push). A push refused at the vote (a bad
manifest) changes nothing, as always."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from weight_sync.common.delta_push import NEEDS_FULL
from weight_sync.common.digest import Digest
from weight_sync.common.group import GroupError, WeightSyncGroup
from weight_sync.common.manifest import DTYPES, Manifest
from weight_sync.common.votes import commit_vote, mismatch_error
from weight_sync.engine_side.targets import TornWeights

TORN = "weights torn"  # in the error of a push that failed after writing: the sidecar restarts that engine


def bucket_pairs(g: WeightSyncGroup, m: Manifest, device: torch.device, written: list[int], digest: Digest
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `m` as it arrives over `g`, a bucket at a time (`written[0]` counts the
    buckets handed on; `digest` takes their bytes), then the commit vote: the iteration ends only
    once every rank holds the bytes the trainer sent, and raises GroupError otherwise (too late
    to keep the old weights: they are torn). A fresh buffer per bucket: a loader may hold a
    layer's tensors until the layer is whole (vLLM's do)."""
    for k, b in enumerate(m.buckets):
        if b.nbytes == 0:
            continue
        buf = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
        g.wait(g.fan_out(buf), f"receiving bucket {k}")
        written[0] += 1
        for t in m.tensors[b.first:b.last]:
            start = t.offset - b.start
            digest.add(buf[start:start + t.nbytes])
            yield t.name, buf[start:start + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)
    g.synchronize()
    if bad := commit_vote(g, digest.value()):
        raise GroupError(mismatch_error(m.version, bad))


def inplace_problems(m: Manifest | None, problems: list[str]) -> list[str]:
    """The problems of a push received in place: full pushes only. A delta needs a copy of the
    weights (the trainer then sends the full weights); an adapter needs little memory (send it as
    usual)."""
    if m is not None and m.delta is not None:
        return [NEEDS_FULL, "an in-place receive takes full pushes only (a delta needs a copy of the weights)"]
    if m is not None and m.adapter is not None:
        return ["an in-place receive takes full pushes only (an adapter push needs little memory: send it as usual)"]
    return problems


def stream_failure(m: Manifest, written: int, e: Exception) -> Exception:
    """What a failed in-place transfer raises: TornWeights naming TORN once a bucket was written
    (the engine must be restarted), else RuntimeError (nothing changed)."""
    if written or isinstance(e, TornWeights):
        return TornWeights(f"in-place push of version {m.version} failed after {written} of {len(m.buckets)} buckets "
                           f"were written: {TORN}; this engine must be restarted ({e})")
    return RuntimeError(f"in-place push of version {m.version} failed before any byte was written, nothing changed: "
                        f"{e}. The group is closed; init_weight_sync again")
