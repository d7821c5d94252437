"""A step's inputs packed on the host into one array, sent to the device in one copy.

Every tensor built from Python data is a host-to-device copy on a GPU, and a step that builds
one per sequence (a block table each, a seed each) is bound by the host. So the runner writes a
decode step's token ids, positions, cache slots, lengths and block tables into one int64 numpy
array (`pack_decode`), and the sampler's per-row parameters into one float64 array
(`step_sampling.SamplingColumns`); each goes to the device as a single tensor whose slices are the inputs.
A GPU's prefill also packs its padded layout (`padded_layout`: one attention call per layer); a CPU's
batch-invariant prefill gives the decode kernel its rows (`prefill_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.native_decode import NativeDecode
from engine.models.attention import PaddedPrefill

# what one more decode chunk costs per layer, in bytes of KV gathered: on the CPU a handful of
# ops (~50-100 us of host time, about 1 MB of memory traffic); on a GPU the same ops are kernel
# launches worth far more bytes than any padding, so a GPU batch is one chunk
CHUNK_OVERHEAD_BYTES = {"cpu": 1 << 20, "cuda": 1 << 62}


@dataclass
class DecodeLayout:
    rows: int
    width: int  # block-table columns: the longest sequence's block count
    groups: int = 1  # KV cache groups (engine/kv_groups.py): a slot and a table of each row in each

    @property
    def size(self) -> int:
        return 4 * self.rows + self.rows * self.width + (self.groups - 1) * (self.rows + self.rows * self.width)

    def slots_at(self, group: int) -> int:
        """Where group `group`'s slots start: the first's between positions and lengths, each later
        group's after the tables before it (its slots, then its table)."""
        n, w = self.rows, self.width
        return 2 * n if group == 0 else 4 * n + n * w + (group - 1) * (n + n * w)

    def table_at(self, group: int) -> int:
        return 4 * self.rows if group == 0 else self.slots_at(group) + self.rows

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named slices of the packed buffer (on whatever device it is); the first group's slots and
        table also as group_slots[0], group_tables[0]."""
        n, w = self.rows, self.width
        slots = [buf[self.slots_at(g) : self.slots_at(g) + n] for g in range(self.groups)]
        tables = [buf[self.table_at(g) : self.table_at(g) + n * w].view(n, w) for g in range(self.groups)]
        return {"ids": buf[0:n], "positions": buf[n : 2 * n], "slots": slots[0], "lengths": buf[3 * n : 4 * n],
                "block_table": tables[0], "group_slots": slots, "group_tables": tables}


def pack_decode(seqs: list, block_size: int, groups: int = 1) -> tuple[np.ndarray, DecodeLayout]:
    """One int64 array holding a decode step's inputs (see DecodeLayout.views); rows in the
    order given. Block tables are padded with block 0 (masked out by the lengths). `groups`: the KV
    cache groups whose slots and tables go along (every group's table as long as the first's)."""
    n = len(seqs)
    width = max(len(s.block_table) for s in seqs)
    layout = DecodeLayout(n, width, groups)
    buf = np.zeros(layout.size, dtype=np.int64)
    ids, pos, lens = buf[:n], buf[n : 2 * n], buf[3 * n : 4 * n]
    slot_rows = [buf[layout.slots_at(g) :][:n] for g in range(groups)]  # numpy views: the loop below is per row
    table_rows = [buf[layout.table_at(g) :][: n * width].reshape(n, width) for g in range(groups)]
    for i, s in enumerate(seqs):
        length = len(s)
        ids[i] = s.token_ids[-1]
        lens[i] = length
        for g in range(groups):
            bt = s.tables[g]
            table_rows[g][i, : len(bt)] = bt
            slot_rows[g][i] = bt[(length - 1) // block_size] * block_size + (length - 1) % block_size
    pos[:] = lens - 1
    return buf, layout


def chunk_cuts(widths: list[int], overhead_rows: float) -> list[tuple[int, int, int]]:
    """Cut a batch sorted by block count into (start, end, blocks) chunks, each attended at its
    longest row's width. Walking down from the longest rows, a new chunk starts where the
    padding it saves (every row left below, padded by the width difference) outweighs one more
    chunk's fixed cost (`overhead_rows` block-rows' worth)."""
    n = len(widths)
    cuts, end, top = [], n, widths[-1]
    for r in range(n - 1, 0, -1):
        # rows [0, r) would be padded to `top` in this chunk, to widths[r - 1] in a new one
        if widths[r - 1] < top and r * (top - widths[r - 1]) > overhead_rows:
            cuts.append((r, end, top))
            end, top = r, widths[r - 1]
    cuts.append((0, end, top))
    return cuts[::-1]


def upload(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """The packed array as one tensor on `device`: on CUDA through pinned memory, without
    blocking the host (the array is not touched again, so the copy may lag)."""
    t = torch.from_numpy(arr)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def padded_layout(seqs: list, spans: list, total: int, block_size: int, group: int = 0):
    """Host arrays of a padded prefill (attention.PaddedPrefill), the GPU's one attention call per
    layer: blocks, query rows, back index, each padded row's position; then (spans, q_len,
    num_blocks). `spans`: (first row, end row, cached prefix length, table) per sequence of the
    `total` rows. None when padding would multiply the queries or keys by more than 4 (one long
    prompt among many short ones): the per-span path then does far less arithmetic."""
    bs, n = block_size, len(spans)
    q_len = max(b - a for a, b, _, _ in spans)
    need = [-(-(c + b - a) // bs) for a, b, c, _ in spans]
    nb = max(need)
    if n * q_len > 4 * total + 64 or n * nb > 4 * sum(need) + 4:
        return None
    blocks = np.zeros((n, nb), dtype=np.int64)
    i = np.arange(q_len)
    rows, qpos = np.empty((n, q_len), dtype=np.int64), np.empty((n, q_len), dtype=np.int64)
    back = np.empty(total, dtype=np.int64)
    for k, ((a, b, c, _), seq) in enumerate(zip(spans, seqs)):
        blocks[k, : need[k]] = seq.tables[group][: need[k]]
        clipped = np.minimum(i, b - a - 1)  # a pad row repeats the span's last token: no empty softmax
        rows[k], qpos[k] = a + clipped, c + clipped
        back[a:b] = k * q_len + np.arange(b - a)
    return blocks.ravel(), rows.ravel(), back, qpos.ravel(), n, q_len, nb


def padded_on_device(buf: torch.Tensor, n: int, q_len: int, nb: int, block_size: int) -> PaddedPrefill:
    """`padded_layout`'s arrays, uploaded in the step's one buffer, as an attention.PaddedPrefill
    (with its causal mask at each row's position)."""
    total = buf.numel() - n * nb - 2 * n * q_len
    blocks, rows = buf[: n * nb], buf[n * nb : n * nb + n * q_len]
    back, qpos = buf[n * nb + n * q_len : n * nb + n * q_len + total], buf[n * nb + n * q_len + total :]
    keys = torch.arange(nb * block_size, device=buf.device)
    positions = qpos.view(n, 1, q_len, 1)
    mask = keys <= positions  # [S, 1, Lq, Lk]: causal at each row's position
    return PaddedPrefill(blocks, rows, back, mask, n, q_len, nb, positions)


def prefill_rows(seqs: list, positions: list[np.ndarray], rows: int, group: int = 0) -> NativeDecode:
    """A prefill step's rows as the decode kernel takes them: each row its sequence's block table (in
    KV cache group `group`) and the keys up to its own position."""
    width = max(len(s.block_table) for s in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.tables[group]
    counts = [len(p) for p in positions]
    lengths = np.concatenate(positions) + 1
    return NativeDecode(torch.from_numpy(np.repeat(tables, counts, axis=0)), torch.from_numpy(lengths),
                        int(lengths.max()) if rows else 1)
