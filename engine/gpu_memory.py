"""How much of a GPU the KV cache gets, vLLM's way: this engine's share of the device's total,
less what the engine itself needs beside the cache at its peak.

The peak is measured, not guessed: a profile run (engine/memory_profile.py) does a
forward of the largest prefill a step can hold and samples a batch, and torch's allocator reports
the most it held. A decode step's own memory grows with its rows (logits, the sampler's sort, the
gather buffers at full width), and its rows are bounded by the cache as well as by max_num_seqs
(every running sequence holds a block of its own): `rows_beside_cache` splits the budget between
the two, so a max_num_seqs far past what the cache can serve sizes nothing by it. The share is
of the device's total (`gpu_memory_utilization` x total), not of what is free, so an engine
started beside a colocated trainer gets its share, not what the trainer left; a share that
does not fit in what is free now is refused by name.
"""

from __future__ import annotations

GiB = 2**30


def kv_budget_bytes(total: int, free: int, utilization: float, held: int, peak: int, reserve: int) -> int:
    """Bytes the KV cache may take on a GPU of `total` bytes with `free` free now.
    held: what this process holds now (torch's reserved memory: weights, buffers);
    peak: the most it held during the profile run (weights, activations, logits, sampler);
    reserve: memory allocated later beside the cache (a push's staging copy).
    Raises ValueError when the share cannot be had or leaves nothing for the cache."""
    share = int(total * utilization)
    if share - held > free:
        others = total - free - held
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {share / GiB:.2f} GiB of this GPU's {total / GiB:.2f} GiB, "
            f"but only {free / GiB:.2f} GiB are free beside this engine's {held / GiB:.2f} GiB (other processes hold "
            f"{others / GiB:.2f} GiB): lower --gpu-memory-utilization to at most {(held + free) / total:.2f}")
    budget = share - peak - reserve
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {share / GiB:.2f} GiB, but its weights and "
            f"largest step take {peak / GiB:.2f} GiB and a push's staging copy {reserve / GiB:.2f} GiB: nothing is "
            "left for the KV cache; raise --gpu-memory-utilization or lower max_num_seqs / max_num_batched_tokens")
    return budget


def rows_beside_cache(budget: int, per_block: int, per_row: int, max_num_seqs: int) -> tuple[int, int]:
    """(decode rows, KV-cache bytes) out of `budget`: a step of `rows` rows takes `per_row` bytes
    each beside the cache, and never has more rows than the cache has blocks (each running sequence
    writes into a block of its own). All max_num_seqs rows when the rest still holds that many
    blocks; else as many rows as blocks, the two filling the budget together."""
    rows = max_num_seqs
    if budget - rows * per_row < rows * per_block:
        rows = max(1, budget // (per_block + per_row))
    return rows, budget - rows * per_row
