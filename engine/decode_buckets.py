"""Which captured decode graph serves a step, and the step's inputs padded to that graph's shape.

A CUDA graph replays fixed shapes, so decode steps are captured per bucket of (rows, block-table
width) and a step runs in the smallest bucket that holds it (engine/decode_graphs.py). Rows step
1, 2, 4, 8, then by 8 to 256, then by 32 (vLLM's spacing, about); widths are powers of two
blocks, so a row's gathered keys are at most twice its own. The last bucket of each is the most
the engine runs (max_num_seqs; max_model_len's blocks).

Pad rows are real rows of the graph: they embed token 0 at position 0, write their key and value
into a pad slot no sequence owns (a block kept apart from the block manager's), and attend to one
key (length 1: a finite softmax); their logits are never read. Pad columns of a block table point
at block 0, masked out by the row's length, as in `step_inputs.pack_decode`.
"""

from __future__ import annotations

import bisect

import numpy as np

from engine.step_inputs import DecodeLayout


def row_buckets(max_rows: int) -> list[int]:
    """The batch sizes graphs are captured for, up to and including `max_rows`."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 256 else 32)
    return out + [max_rows]


def width_buckets(max_blocks: int) -> list[int]:
    """The block-table widths graphs are captured for: powers of two, then `max_blocks`."""
    out, w = [], 1
    while w < max_blocks:
        out.append(w)
        w *= 2
    return out + [max_blocks]


def bucket_of(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `n`; None past the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def pad_decode(buf: np.ndarray, layout: DecodeLayout, rows: int, width: int, pad_slots: list[int]) -> np.ndarray:
    """`step_inputs.pack_decode`'s array for `layout`, laid out for a graph of `rows` x `width`
    (DecodeLayout(rows, width, layout.groups).views reads it): the real rows first, as packed, then pad
    rows, writing into `pad_slots` (one slot per KV cache group)."""
    n, w = layout.rows, layout.width
    if n > rows or w > width:
        raise ValueError(f"a decode step of {n} rows x {w} blocks does not fit a graph of {rows} x {width}")
    padded = DecodeLayout(rows, width, layout.groups)
    out = np.zeros(padded.size, dtype=np.int64)
    for k in (0, 1, 3):  # ids, positions, lengths
        out[k * rows : k * rows + n] = buf[k * n : (k + 1) * n]
    out[3 * rows + n : 4 * rows] = 1
    for g, pad_slot in enumerate(pad_slots):
        slots, src = out[padded.slots_at(g) :], buf[layout.slots_at(g) :]
        slots[:n], slots[n:rows] = src[:n], pad_slot
        table = out[padded.table_at(g) :][: rows * width].reshape(rows, width)
        table[:n, :w] = buf[layout.table_at(g) :][: n * w].reshape(n, w)
    return out
