"""A delta push on the receiver (weight_sync/common/delta_push.py): the result made from the
weights it serves (its base) and the payload that arrived."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from weight_sync.common import delta as D
from weight_sync.common.delta_push import BITMAP, POSITIONS, VALUES
from weight_sync.common.digest import NONE, staged_digest
from weight_sync.common.manifest import DTYPES, Manifest
from weight_sync.engine_side.targets import views

log = logging.getLogger(__name__)


def fill_base(full: Manifest, result: torch.Tensor, base: Sequence[torch.Tensor]) -> None:
    """The weights the receiver serves, laid into `result` as the full push would lay them (cast
    to the wire dtype: exact when they came in it)."""
    with torch.no_grad():
        for (_, view), t in zip(views(full, result), base):
            view.copy_(t)


def apply_payload(m: Manifest, full: Manifest, payload: torch.Tensor, result: torch.Tensor) -> None:
    """Every part of delta manifest `m` (its bytes in `payload`) written into `result`. Raises
    ValueError when a part does not fit (positions outside its tensor, say)."""
    sent = {t.name: payload[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]) for t in m.tensors}
    empty = torch.empty(0, dtype=torch.uint8, device=payload.device)
    for p in m.delta.parts:
        spec = full.tensors[p.tensor]
        dst = result[spec.offset:spec.offset + spec.nbytes].view(DTYPES[spec.dtype])
        positions = sent.get(spec.name + POSITIONS, sent.get(spec.name + BITMAP, empty))
        try:
            D.apply(dst, D.Delta(p.kind, positions, sent[spec.name + VALUES]))
        except ValueError as e:
            raise ValueError(f"{spec.name}: {e}") from None


class DeltaApply:
    """A delta push's result, made while its payload arrives: the served weights (`base`) copied
    into `result` while the first buckets arrive (`copy_base`), then, once every byte is in, the
    payload applied and the result's digest taken for the commit vote (`digest_of`). `seconds`:
    what each took."""

    def __init__(self, m: Manifest, full: Manifest, result: torch.Tensor, base: Sequence[torch.Tensor]):
        self.m, self.full, self.result, self.base = m, full, result, base
        self.seconds: dict[str, float] = {}

    def copy_base(self) -> None:
        t = time.perf_counter()
        fill_base(self.full, self.result, self.base)
        self.seconds["base_seconds"] = time.perf_counter() - t

    def digest_of(self, payload: torch.Tensor) -> int:
        t = time.perf_counter()
        try:
            apply_payload(self.m, self.full, payload, self.result)
        except ValueError as e:  # votes a digest nobody holds: every rank stops at the commit vote
            log.error("delta push of version %d does not apply, nothing will be committed: %s", self.m.version, e)
            return NONE
        digest = staged_digest(self.full, self.result)
        self.seconds["apply_seconds"] = time.perf_counter() - t
        return digest
