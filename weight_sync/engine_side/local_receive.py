"""Pushes that arrive with no group, on this host: a trainer's shared buffer (staging_sources.py's
SharedSource) and a push directory (a file push, or a host copy). Each fills the receiver's staging
buffer as a broadcast would and commits the same way (`PushReceiver.commit`), so a bad manifest, a
buffer that cannot be mapped or a partial file changes nothing (PushRefused)."""

from __future__ import annotations

import time

from weight_sync.common.digest import NONE, staged_digest
from weight_sync.common.votes import PushRefused
from weight_sync.engine_side.receive import Arrived, PushReceiver, derived, pages_held
from weight_sync.engine_side.staging_sources import fill_from_file
from weight_sync.engine_side.targets import sync_device


@pages_held
def receive_shared(r: PushReceiver, manifest, handle: dict) -> dict:
    """The trainer's buffer on this host (weight_sync.engine_side.staging_sources) copied into staging, then
    committed. Raises PushRefused (nothing changed) for a bad manifest or a buffer that
    cannot be mapped."""
    t0 = time.perf_counter()
    m, staging, problems = r._check_and_stage(manifest)
    source = None
    if not problems and m.delta is not None:
        problems = ["a shared-memory push takes full pushes only (the trainer's buffer holds the full weights)"]
    if not problems:
        source, problems = r.shared.open(handle, m)
    if problems:
        r.pool.give_back(staging)
        raise PushRefused("weight push refused, nothing changed: " + "; ".join(problems))
    t1 = time.perf_counter()
    staging.copy_(source)  # every byte is here before anything is committed
    sync_device(r.device)
    a = Arrived(m, r.target.plan(m, staging), t0, t1, time.perf_counter(), 0.0, staged_digest(m, staging))
    return r.commit(derived(r.target, a), f"shared ({handle.get('kind')})", buckets=0)


@pages_held
def load_from_path(r: PushReceiver, path: str, manifest=None) -> dict:
    """A push directory (weight_sync.common.push_dir): every tensor read into staging before anything is
    committed, so a bad or partial file changes nothing (ValueError)."""
    from weight_sync.common.push_dir import read_digest, read_manifest

    t0 = time.perf_counter()
    m, problems = r._check(manifest if manifest is not None else read_manifest(path))
    if not problems and m.delta is not None:
        problems = ["a push directory holds full weights, not a delta"]
    if problems:
        raise PushRefused("weight load refused, nothing changed: " + "; ".join(problems))
    staging = r.pool.take(m.layout_bytes)
    try:
        fill_from_file(m, staging, path)
        digest = staged_digest(m, staging)
        if (meant := read_digest(path)) not in (None, NONE, digest):  # a host copy written meanwhile
            raise ValueError(f"its bytes changed while they were read (digest {digest:x}, {meant:x} written)")
    except Exception as e:
        r.pool.give_back(staging)
        raise PushRefused(f"weight load from {path} failed, nothing changed: {e}") from None
    a = Arrived(m, r.target.plan(m, staging), t0, t0, time.perf_counter(), 0.0, digest)
    return r.commit(derived(r.target, a), "safetensors", buckets=0)
