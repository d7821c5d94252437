"""A push's content digest: the trainer's fingerprint of the bytes it meant to send, compared in
the commit vote (weight_sync/common/votes.py) with each worker's fingerprint of what it staged, so that a
push that moved no bytes, lost or altered a chunk, or applied a delta on the wrong base cannot
commit (issue 38, "no silent success").

xxh3-128 over each tensor's raw bytes in manifest order (names, dtypes and shapes are the
manifest's, which every rank agreed on in the manifest vote), cut to 62 bits so it travels in an
int64 vote. xxh3 hashes 11.7 GB/s on one core here (SHA-256 1.4): about 25 ms per side for a
270 MB push. It checks that the bytes are the ones meant; it is no defence against a forger
(whoever holds the group's secret can send anything).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xxhash

from weight_sync.common.checksum import tensor_bytes

BITS = 62
NONE = -1  # no digest known (the checkpoint's weights, an adapter merged into them)


class Digest:
    """Fed tensor by tensor, in manifest order."""

    def __init__(self):
        self._h = xxhash.xxh3_128()

    def add(self, t: torch.Tensor) -> None:
        self._h.update(tensor_bytes(t))

    def value(self) -> int:
        return int.from_bytes(self._h.digest()[:8], "little") & ((1 << BITS) - 1)


def digest_of(tensors: Iterable[torch.Tensor]) -> int:
    d = Digest()
    for t in tensors:
        d.add(t)
    return d.value()


def staged_digest(m, staging: torch.Tensor) -> int:
    """The digest of a manifest's tensors as laid out in a staging buffer (padding left out)."""
    return digest_of(staging[t.offset:t.offset + t.nbytes] for t in m.tensors)
