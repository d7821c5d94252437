"""How many KV-cache blocks an engine allocates: as configured (`num_kv_blocks`), else enough
for every running sequence at full length if the memory budget holds them, else what it holds;
never fewer than one full-length sequence needs. The budget itself is the runner's to measure
(on a GPU: engine/gpu_memory.py after a profile run; on the CPU: `kv_cache_memory_gb`).

A model windowed on every layer holds no sequence's blocks behind its window (engine/block_manager.py
hands them back before each step), so "at full length" there means its window's blocks, plus one
prefill step's prompts written whole before theirs go back (as vLLM's sliding-window spec counts
`window - 1 + max_num_batched_tokens` tokens)."""

from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfig


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """One block's keys and values over every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def kv_cache_blocks(budget_bytes: int, per_block: int, want: int, min_blocks: int) -> int:
    """KV blocks to allocate: enough for every running sequence at full length (`want`) if the
    budget holds them, else what it holds; never fewer than one full-length sequence needs
    (raises when even that does not fit)."""
    fits = max(0, budget_bytes) // per_block
    if fits < min_blocks:
        raise ValueError(f"the KV cache budget ({budget_bytes / 2**30:.2f} GiB) holds {fits} blocks, fewer than "
                         f"one sequence of max_model_len needs ({min_blocks}): lower max_model_len or raise "
                         "gpu_memory_utilization / kv_cache_memory_gb")
    return min(want, fits)


def blocks_wanted(max_num_seqs: int, max_model_len: int, block_size: int, max_num_batched_tokens: int,
                  window: int | None = None) -> int:
    """Blocks for every running sequence at full length: `max_model_len` tokens each, or under a
    window on every layer its window's (a block more where the window starts mid-block) and one
    prefill step's worth of whole prompts, never more than the full lengths."""
    full = max_num_seqs * -(-max_model_len // block_size)
    if not window:
        return full
    held = max_num_seqs * (-(-window // block_size) + 1) + -(-max_num_batched_tokens // block_size)
    return min(full, held)


def group_blocks(cfg: EngineConfig, per_block: list[int], windows: list[int | None],
                 budget_bytes: Callable[[int], int]) -> list[int]:
    """The blocks `cfg` gets in each KV cache group (engine/kv_groups.py: its blocks' bytes, its window).
    `budget_bytes(one_sequence)` is called only when `cfg` leaves the number to the memory budget (it may
    run a profile step). Each group gets what it wants (blocks_wanted) where the budget holds it all; else
    as many sequences at full length as fit, a windowed group holding their windows and one prompt written
    whole (the prefill room past that only speeds admission, the sequences held spare recomputes), and
    what is left shared in proportion to what each group still wants. `num_kv_blocks` sets the
    full-attention group's (a windowed group beside it gets as many, or the fewer it wants)."""
    min_blocks = -(-cfg.max_model_len // cfg.block_size)

    def wanted(seqs: int, prefill_tokens: int) -> list[int]:
        return [blocks_wanted(seqs, cfg.max_model_len, cfg.block_size, prefill_tokens, w) for w in windows]

    def nbytes(blocks: list[int]) -> int:
        return sum(p * n for p, n in zip(per_block, blocks))

    wants = wanted(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    if cfg.num_kv_blocks is not None:
        if cfg.num_kv_blocks < min_blocks:
            raise ValueError(
                f"num_kv_blocks={cfg.num_kv_blocks} cannot hold one sequence of max_model_len="
                f"{cfg.max_model_len} tokens (needs {min_blocks} blocks of {cfg.block_size})"
            )
        hybrid = len(windows) > 1
        return [min(cfg.num_kv_blocks, want) if hybrid and w else cfg.num_kv_blocks for w, want in zip(windows, wants)]
    least = sum(p * min_blocks for p in per_block)
    budget = budget_bytes(least)
    if len(per_block) == 1:
        return [kv_cache_blocks(budget, per_block[0], wants[0], min_blocks)]
    if budget < least:
        raise ValueError(f"the KV cache budget ({budget / 2**30:.2f} GiB) holds fewer blocks than one sequence of "
                         "max_model_len needs in each group of layers: lower max_model_len or raise "
                         "gpu_memory_utilization / kv_cache_memory_gb")
    if nbytes(wants) <= budget:
        return wants
    seqs = max(s for s in range(1, cfg.max_num_seqs + 1) if nbytes(wanted(s, cfg.max_model_len)) <= budget)
    base = wanted(seqs, cfg.max_model_len)
    share = (budget - nbytes(base)) / sum(p * (want - b) for p, want, b in zip(per_block, wants, base))
    return [b + int((want - b) * share) for want, b in zip(wants, base)]
