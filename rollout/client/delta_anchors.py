"""`DeltaAnchors`: the count rollout.client.weight_sync_client keeps of the deltas since the last full push."""

from __future__ import annotations

from dataclasses import dataclass

# A full push every this many (verl and Fireworks send a full "anchor" every 20-30 deltas): a delta
# is exact by construction (every push's digest is checked), the anchor bounds what a bug could cost.
DELTA_ANCHOR_EVERY = 20
# Pushes shorter than this are not compared (their times are mostly noise, and either way costs
# little): the choice by bytes stands.
COMPARED_FROM_S = 0.5


@dataclass
class DeltaAnchors:
    """When the full weights go (an "anchor") rather than a delta (weight_sync/common/delta_push.py): every
    `every` pushes, and whenever the group is new (a sidecar joined, went, was healed, or a push failed).
    And whether a delta pays at all here (`auto`): it saves bytes on the wire but costs passes over
    the whole model on both sides (encode, the kept base, the apply, the result's digest), which on a
    fast link took longer than the full weights (1.7B on loopback: 14 s against 1.7 s)."""

    every: int = DELTA_ANCHOR_EVERY
    since: int | None = None  # deltas since the last full push (None: the next is full)
    full_s: float | None = None  # the last full push's seconds, call to reply
    delta_s: float | None = None  # the last delta push's

    def due(self) -> bool:
        return self.since is None or self.since + 1 >= self.every

    def count(self, trainer, seconds: float | None = None) -> None:
        """A push went (`trainer`: the sender's result, or its error: the next push is full) in
        `seconds`."""
        if isinstance(trainer, BaseException):
            self.since = None
            return
        if trainer.get("delta"):
            self.since = (self.since or 0) + 1
            self.delta_s = seconds if seconds is not None else self.delta_s
        else:
            self.since = 0
            self.full_s = seconds if seconds is not None else self.full_s

    def auto(self) -> bool | None:
        """What a push that leaves it to the client sends (run_push's `delta`): a delta where it
        fits and is fewer bytes (None), or, once a delta took longer here than a full push (and over
        COMPARED_FROM_S), the full weights with no base kept (False) until the group changes."""
        if self.full_s is not None and self.delta_s is not None and self.delta_s >= max(self.full_s, COMPARED_FROM_S):
            return False
        return None

    def reset(self) -> None:
        """The group is new: the next push is full, and whether deltas pay is measured again."""
        self.since = self.full_s = self.delta_s = None
