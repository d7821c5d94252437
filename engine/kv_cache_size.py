"""How many KV-cache blocks an engine allocates: as configured (`num_kv_blocks`), else enough
for every running sequence at full length if the memory budget holds them, else what it holds;
never fewer than one full-length sequence needs. The budget itself is the runner's to measure
(on a GPU: engine/gpu_memory.py after a profile run; on the CPU: `kv_cache_memory_gb`)."""

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


def num_kv_blocks(cfg: EngineConfig, per_block: int, budget_bytes: Callable[[int], int]) -> int:
    """The blocks `cfg` gets; `budget_bytes(one_sequence)` is called only when `cfg` leaves the
    number to the memory budget (it may run a profile step)."""
    min_blocks = -(-cfg.max_model_len // cfg.block_size)
    if cfg.num_kv_blocks is not None:
        if cfg.num_kv_blocks < min_blocks:
            raise ValueError(
                f"num_kv_blocks={cfg.num_kv_blocks} cannot hold one sequence of max_model_len="
                f"{cfg.max_model_len} tokens (needs {min_blocks} blocks of {cfg.block_size})"
            )
        return cfg.num_kv_blocks
    return kv_cache_blocks(budget_bytes(per_block * min_blocks), per_block, cfg.max_num_seqs * min_blocks, min_blocks)
