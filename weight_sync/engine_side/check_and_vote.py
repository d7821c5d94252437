"""Steps 1 and 2 of a worker's side of a push (weight_sync/engine_side/receive.py), before any byte
moves: the manifest checked against the engine's target, the wait at the vote's gate, the status
the worker votes, and what the manifest vote decided for it."""

from __future__ import annotations

from weight_sync.common.delta_push import NEEDS_FULL, check_delta, full_manifest
from weight_sync.common.group import WeightSyncGroup
from weight_sync.common.manifest import Manifest
from weight_sync.common.votes import VOTE_DELTA_BASE, VOTE_NEEDS_BASE, VOTE_OK, VOTE_REFUSED, Verdict, describe
from weight_sync.engine_side.lora_target import NEEDS_BASE
from weight_sync.engine_side.targets import WeightTarget


def check_push(manifest, target: WeightTarget, version: int | None, digest: int) -> tuple[Manifest | None, list[str]]:
    """The manifest read and every problem that keeps `target` from taking it; `version` and
    `digest`: of the weights it serves (a delta's base must be those)."""
    try:
        m = Manifest.from_wire(manifest)
    except Exception as e:
        return None, [f"malformed manifest: {e}"]
    if m.delta is not None:
        return m, _check_delta(m, target, version, digest)
    return m, target.check(m)


def _check_delta(m: Manifest, target: WeightTarget, version: int | None, digest: int) -> list[str]:
    """A delta: consistent, its result a push this engine takes, and its base what it serves."""
    problems = check_delta(m)
    if problems:
        return problems
    full = full_manifest(m)
    problems = target.check(full)
    if problems:
        return problems
    d = m.delta
    if (d.base_version, d.base_digest) != (version, digest):
        return [NEEDS_FULL, f"the delta applies on version {d.base_version}; this worker holds {serving(version)}"]
    try:
        target.base(full)
    except Exception as e:  # weights it keeps no copy of (an in-place push into vLLM)
        return [NEEDS_FULL, f"its weights cannot be read as a delta's base: {e}"]
    return []


def wait_for_vote(g: WeightSyncGroup, push_id: str) -> str | None:
    """Mark this worker ready for push `push_id`'s vote and wait until the trainer opens it (every
    rank is there): None then; else why the push ends here, nothing changed (called off: a rank of
    the group went; or the trainer is gone), instead of in a vote that would wait out the group's
    timeout."""
    try:
        g.mark_ready(push_id)
        if g.wait_vote(push_id):
            return None
        return "the trainer called it off (a rank of the group went or failed before voting)"
    except Exception as e:  # the trainer's store is gone, or nobody came within the group's timeout
        return describe(e)


def vote_status(problems: list[str]) -> int:
    """What a worker votes in the manifest vote: accept, or why not (the first problem says)."""
    return (VOTE_OK if not problems else VOTE_NEEDS_BASE if problems[0] is NEEDS_BASE
            else VOTE_DELTA_BASE if problems[0] is NEEDS_FULL else VOTE_REFUSED)


def serving(version: int | None) -> str:
    return "the checkpoint's weights" if version is None else f"version {version}"


def refusal(m: Manifest | None, problems: list[str], verdict: Verdict) -> str | None:
    """Why the manifest vote refused the push on this worker; None when every rank accepted the
    same manifest."""
    if problems:
        return "weight push refused, nothing changed: " + "; ".join(problems)
    if verdict.worst != VOTE_OK:
        return (f"weight push of version {m.version} refused by another rank (the trainer or another worker; see "
                "its error), nothing changed")
    if not verdict.same_manifest:
        return f"weight push of version {m.version} refused: the ranks hold different manifests"
    return None
