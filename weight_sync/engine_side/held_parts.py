"""An update that arrives in parts (SGLang's trainers send one `update_weights_from_distributed`
call per bucket, rollout/sglang_transfer.py): each part is received and staged as any overlapped
push (weight_sync/engine_side/overlapped_receive.py), then held here, uncommitted, until the
sidecar commits every part at once (between two engine steps: the engine never serves a mix of
the update's parts and the weights before it) or drops them all (a trainer gone mid-update)."""

from __future__ import annotations

from weight_sync.engine_side.overlapped_receive import OverlappedReceive
from weight_sync.engine_side.receive import Arrived


class HeldParts:
    def __init__(self, overlapped: OverlappedReceive):
        self.overlapped = overlapped
        self.parts: list[Arrived] = []

    def hold(self) -> dict:
        """The staged part, kept; raises its error if it failed (a refusal as PushRefused)."""
        self.parts.append(self.overlapped.take_staged())
        return {"parts": len(self.parts), "tensors": sum(len(a.m.tensors) for a in self.parts)}

    def commit(self) -> dict:
        """Every held part committed, in the order they arrived (a name sent twice: the later wins)."""
        parts, self.parts = self.parts, []
        out = {}
        for a in parts:
            out = self.overlapped.receiver.commit(a, "broadcast, in parts")
        out["parts"] = len(parts)
        out["bytes"] = sum(a.m.total_bytes for a in parts)
        return out

    def drop(self) -> int:
        parts, self.parts = self.parts, []
        for a in parts:
            self.overlapped.receiver.pool.give_back(a.plan.staging)
        return len(parts)
