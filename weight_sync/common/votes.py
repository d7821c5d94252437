"""The votes of a push, as every rank casts them (trainer and workers alike), and the push's errors.

A push has two votes, each an all-gather of a few integers from every rank:

1. the manifest vote, before any byte moves (its element-wise MAX): each rank says whether it accepts the manifest
   (`VOTE_OK`) or why not, and which manifest it holds (its digest, twice: max of d and of -d
   are both d only if every rank holds the same one);
2. the commit vote, after the last bucket: every rank says which bytes it holds, as the digest of
   the tensors it staged (weight_sync/common/digest.py; the trainer's, of what it meant to send), and
   every rank sees everyone's. Only when every worker's equals the trainer's does any commit: a
   push that moved no bytes, lost or altered a chunk, or patched the wrong base cannot commit.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import RefusedError

# Statuses, ordered: the worst (largest) one wins the MAX.
VOTE_OK, VOTE_REFUSED, VOTE_STALE, VOTE_UNREADABLE = 0, 1, 2, 3
VOTE_NEEDS_BASE = 4  # a LoRA adapter push to a worker without its base (weight_sync.common.lora): push it with the base
VOTE_DELTA_BASE = 5  # a delta push to a worker without its base (weight_sync.common.delta_push): push the full weights


def describe(e: BaseException) -> str:
    """An error for a person (errors from an engine arrive as "Type: message" already)."""
    return str(e) or type(e).__name__


class WeightSyncError(RuntimeError):
    """A push failed: the transfer broke and the group must be formed again. A push refused before
    any byte moved (the group still usable) is a `WeightSyncRefusedError`, one of these too.
    `reasons`: each party's words, the trainer's first."""

    def __init__(self, message: str, reasons: list[str] | None = None):
        super().__init__(message)
        self.reasons = reasons or [message]

    @property
    def refused(self) -> bool:
        return isinstance(self, RefusedError)


class WeightSyncRefusedError(WeightSyncError, RefusedError):
    """A push refused before any byte moved: nothing changed and the group is still usable (error
    kind "refused", engine.errors.RefusedError being the root of every refusal)."""

    error_kind = "refused"


class StaleManifestError(WeightSyncRefusedError):
    """A push prepared with `reuse_layout=True` found the weights no longer match the reused
    layout (names, dtypes or shapes changed). Refused before any byte moved; prepare afresh."""


class NeedsBaseError(WeightSyncRefusedError):
    """An adapter push refused before any byte moved because a worker does not hold the base it
    applies to: push again with the base in the manifest (weight_sync.trainer.push does)."""


class DeltaBaseError(WeightSyncRefusedError):
    """A delta push refused before any byte moved because a worker does not hold the weights it
    applies to (a restarted engine, a missed push): push the full weights (weight_sync.trainer.push does)."""


class PushRefused(RefusedError):
    """A worker refused a push (or a load) before any byte moved; nothing changed and its group is
    still usable. Error kind "refused" across the engine's process boundary (engine/messages.py)."""


@dataclass(frozen=True)
class Verdict:
    """What the manifest vote decided."""

    worst: int  # the largest status any rank cast
    same_manifest: bool  # every rank holds the manifest with this rank's digest

    @property
    def ok(self) -> bool:
        return self.worst == VOTE_OK and self.same_manifest


def manifest_vote(group, status: int, digest: int) -> Verdict:
    """Cast this rank's vote on a manifest and read the verdict (raises GroupError if the
    collective fails)."""
    import torch  # here: the sidecar's front end uses this module's errors and imports no torch

    r = group.allreduce_max(torch.tensor([status, digest, -digest], dtype=torch.int64), "manifest vote")
    return Verdict(int(r[0]), int(r[1]) == digest and int(-r[2]) == digest)


def commit_vote(group, digest: int) -> list[int]:
    """Cast this rank's digest of the push's bytes; returns the ranks whose digest differs from
    the trainer's (rank 0): commit only if none. Raises GroupError if the collective fails (a
    rank that failed never votes)."""
    import torch

    rows = group.allgather(torch.tensor([digest], dtype=torch.int64), "commit vote")[:, 0].tolist()
    return [r for r, d in enumerate(rows) if d != rows[0]]


def mismatch_error(version: int, ranks: list[int]) -> str:
    return (f"push of version {version}: the bytes ranks {ranks} staged are not the ones the trainer sent (their "
            "digests differ from its own); nothing was committed")
