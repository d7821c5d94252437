"""`DeltaAnchors`: the count rollout.weight_sync_client keeps of the deltas since the last full push."""

from __future__ import annotations

from dataclasses import dataclass

# A full push every this many (verl and Fireworks send a full "anchor" every 20-30 deltas): a delta
# is exact by construction (every push's digest is checked), the anchor bounds what a bug could cost.
DELTA_ANCHOR_EVERY = 20


@dataclass
class DeltaAnchors:
    """When the full weights go (an "anchor") rather than a delta (weight_sync/common/delta_push.py): every
    `every` pushes, and whenever the group is new (a sidecar joined, went, was healed, or a push failed)."""

    every: int = DELTA_ANCHOR_EVERY
    since: int | None = None  # deltas since the last full push (None: the next is full)

    def due(self) -> bool:
        return self.since is None or self.since + 1 >= self.every

    def count(self, trainer) -> None:
        """A push went (`trainer`: the sender's result, or its error: the next push is full)."""
        if isinstance(trainer, BaseException):
            self.since = None
        elif trainer.get("delta"):
            self.since = (self.since or 0) + 1
        else:
            self.since = 0

    def reset(self) -> None:
        self.since = None
