"""Routed experts (routing replay, R3: arXiv 2510.11370): the expert ids each sparse layer chose for
each token a request computed, returned so that a trainer can route its forward the same way.

After a step's forward, every sparse block holds its choices for the step's tokens (`last_ids`,
[T, k]); `take` stacks them into [T, layers, k] in the smallest integer type that holds the expert
count (uint8 up to 256 experts, else int16, as SGLang's compact form) and cuts out each asking
sequence's rows: the positions it computed this step that it has not returned before. A position's
row is the routing of the token at that position as the step's input: the prompt's tokens at the
prefill, each sampled token at the decode step after it (the last sampled token is never an input).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sequence import Sequence


def compact_dtype(experts: int) -> torch.dtype:
    return torch.uint8 if experts <= 256 else torch.int16


def step_ids(blocks: list) -> np.ndarray:
    """[T, layers, k] of this step's choices, compact."""
    ids = torch.stack([b.last_ids for b in blocks], dim=1)
    return ids.to(compact_dtype(blocks[0].gate.weight.shape[0])).cpu().numpy()


def take(seqs: list[Sequence], is_prefill: bool, blocks: list) -> dict[int, np.ndarray]:
    """seq_id -> the rows this step adds to its routed experts, for the sequences that asked; each
    one's `routed_from` moves past them. Call after the forward, before the step's tokens are added."""
    asking = [s.params.return_routed_experts for s in seqs]
    if not any(asking) or not blocks:
        return {}
    ids, rows, offset = step_ids(blocks), {}, 0
    for seq, wants in zip(seqs, asking):
        start = seq.num_computed_tokens if is_prefill else len(seq) - 1
        n = len(seq) - start
        if wants:
            first = max(start, seq.routed_from)
            rows[seq.seq_id] = ids[offset + first - start: offset + n]
            seq.routed_from = max(seq.routed_from, len(seq))
        offset += n
    return rows
