"""What the manifest vote means for the trainer's push (weight_sync/trainer/sender.py): go on, or
the error its push raises, each kind its own type so that `run_push` knows what to do next
(weight_sync/common/votes.py holds the votes and the errors)."""

from __future__ import annotations

from weight_sync.common.manifest import Manifest
from weight_sync.common.votes import (
    VOTE_DELTA_BASE, VOTE_NEEDS_BASE, VOTE_OK, VOTE_STALE, DeltaBaseError, NeedsBaseError, StaleManifestError,
    Verdict, WeightSyncError, WeightSyncRefusedError,
)


def vote_refusal(status: int, m: Manifest, problem: str, verdict: Verdict) -> WeightSyncError | None:
    """None when every rank took the same manifest; else what the push raises. The trainer's own
    `status` first (its weights no longer fit a reused layout: StaleManifestError; unreadable), then
    the workers': a delta's base missing (DeltaBaseError: push the full weights), an adapter's base
    missing (NeedsBaseError: push it with its base), a refusal, different manifests."""
    if status == VOTE_STALE:
        return StaleManifestError(f"push of version {m.version} not sent: {problem}")
    if status != VOTE_OK:
        return WeightSyncRefusedError(f"push of version {m.version} refused before any byte moved: {problem}")
    if verdict.worst == VOTE_DELTA_BASE:
        return DeltaBaseError(f"delta push of version {m.version}: a worker does not hold its base "
                              f"(version {m.delta and m.delta.base_version}); nothing moved")
    if verdict.worst == VOTE_NEEDS_BASE:
        return NeedsBaseError(f"adapter push of version {m.version}: a worker lacks its base; nothing moved")
    if verdict.worst != VOTE_OK:
        return WeightSyncRefusedError(f"push of version {m.version} refused by a worker before any byte moved (the "
                               "workers' errors say why); nothing changed")
    if not verdict.same_manifest:
        return WeightSyncError(f"push of version {m.version} refused: the ranks hold different manifests",
                               refused=True)
    return None
