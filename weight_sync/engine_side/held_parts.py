"""An update that arrives in parts (SGLang's trainers send one `update_weights_from_distributed`
call per bucket, rollout/sidecar/sglang_transfer.py): each part is received and staged as any overlapped
push (weight_sync/engine_side/overlapped_receive.py), then held here, uncommitted, until the
sidecar commits every part at once (between two engine steps: the engine never serves a mix of
the update's parts and the weights before it) or drops them all (a trainer gone mid-update).

Several parts are joined into one push before the commit (one copy into one staging buffer): a
target commits a push whole (vLLM's reload, the copy it keeps of the weights as pushed).

A tied alias (`lm_head.weight` sent besides `model.embed_tokens.weight`, in a part of its own: the
manifest check takes each parameter once) must carry its parameter's bytes exactly; it is then left
out of the commit, as SGLang's loaders skip it. Bytes that differ refuse the update."""

from __future__ import annotations

import time

import torch

from weight_sync.common.digest import NONE
from weight_sync.common.manifest import ALIGNMENT, Bucket, Manifest, TensorSpec
from weight_sync.engine_side.overlapped_receive import OverlappedReceive
from weight_sync.engine_side.receive import Arrived


class HeldParts:
    def __init__(self, overlapped: OverlappedReceive):
        self.overlapped = overlapped
        self.parts: list[Arrived] = []
        self.tied: dict[str, str] = {}  # alias -> its parameter's name, as the update's sender named both

    def hold(self, tied: dict[str, str] | None = None) -> dict:
        """The staged part, kept; raises its error if it failed (a refusal as PushRefused), or if it
        holds a tied alias (`tied`: alias -> parameter) whose bytes differ from its parameter's."""
        self.parts.append(self.overlapped.take_staged())
        self.tied.update(tied or {})
        self._check_tied()
        return {"parts": len(self.parts), "tensors": sum(len(a.m.tensors) for a in self.parts)}

    def _held(self) -> dict[str, torch.Tensor]:
        """The bytes of every held tensor, by name (the later part's for a name sent twice)."""
        return {t.name: a.plan.staging[t.offset:t.offset + t.nbytes] for a in self.parts for t in a.m.tensors}

    def _check_tied(self) -> None:
        from weight_sync.common.votes import PushRefused

        held = self._held()
        differ = [f"{alias} (tied to {name})" for alias, name in self.tied.items()
                  if alias in held and name in held and not torch.equal(held[alias], held[name])]
        if differ:
            raise PushRefused("tied weights whose bytes differ from the weight they are tied to: "
                              + ", ".join(differ) + "; nothing changed")

    def commit(self) -> dict:
        """Every held part committed as one push (a name sent twice: the later part's)."""
        parts, self.parts = self.parts, []
        names = {t.name for a in parts for t in a.m.tensors}
        skip, self.tied = {alias for alias, name in self.tied.items() if alias in names and name in names}, {}
        if not parts:
            raise RuntimeError("no update held to commit")
        a = parts[0] if len(parts) == 1 and not skip else self._joined(parts, skip)
        out = self.overlapped.receiver.commit(a, "broadcast, in parts")
        return {**out, "parts": len(parts)}

    def _joined(self, parts: list[Arrived], skip: set[str] = frozenset()) -> Arrived:
        """The parts' tensors in one staging buffer, each part's layout at an aligned offset (but
        those named in `skip`: tied aliases whose bytes are their parameter's)."""
        receiver = self.overlapped.receiver
        starts, pos = [], 0
        for a in parts:
            starts.append(pos)
            pos = -(-(pos + a.m.layout_bytes) // ALIGNMENT) * ALIGNMENT
        latest = {t.name: (k, t) for k, a in enumerate(parts) for t in a.m.tensors  # the later part wins
                  if t.name not in skip}
        tensors = [TensorSpec(t.name, t.dtype, t.shape, starts[k] + t.offset, t.nbytes) for k, t in latest.values()]
        tensors.sort(key=lambda t: t.offset)
        m = Manifest(version=parts[-1].m.version, tensors=tensors,
                     buckets=[Bucket(s, s + a.m.layout_bytes, 0, 0) for s, a in zip(starts, parts)],
                     total_bytes=sum(t.nbytes for t in tensors), layout_bytes=pos, bucket_bytes=max(1, pos),
                     alignment=min(a.m.alignment for a in parts), push_id=parts[-1].m.push_id, partial=True)
        staging = receiver.pool.take(pos)
        for s, a in zip(starts, parts):
            staging[s:s + a.m.layout_bytes].copy_(a.plan.staging[:a.m.layout_bytes])
            receiver.pool.give_back(a.plan.staging)
        t0 = time.perf_counter()
        plan = receiver.target.plan(m, staging)
        return Arrived(m, plan, parts[0].t0, parts[0].t1, time.perf_counter(), time.perf_counter() - t0, NONE)

    def drop(self) -> int:
        parts, self.parts, self.tied = self.parts, [], {}
        for a in parts:
            self.overlapped.receiver.pool.give_back(a.plan.staging)
        return len(parts)
