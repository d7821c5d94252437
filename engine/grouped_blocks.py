"""The KV blocks of a model with a cache per group of layers (engine/kv_groups.py: its full-attention
layers', its windowed layers'), behind the one block manager's interface the scheduler calls (vLLM's
KV cache coordinator): a BlockManager per group, each with its own pool and each sequence's own table.

A sequence is admitted when every group has room for it, and appends a token when every group does; a
prefix-cache hit is as long as every group serves (the full group's blocks from the first on, the windowed
group's last window of them: its earlier blocks went back to its free list early and may be gone). The
windowed group hands back each sequence's blocks behind its window as it decodes; the full group keeps
them. Counters are the first group's (each group looks up the same tokens).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.block_manager import BlockManager
from engine.sequence import Sequence


def for_runner(runner, enable_prefix_caching: bool) -> BlockManager | GroupedBlocks:
    """The block bookkeeping of `runner`'s cache: one manager, or one per group behind GroupedBlocks. A
    windowed group's released table entries point at its spare block (the one past its own)."""
    managers = [BlockManager(n, runner.block_size, enable_prefix_caching, window, n if window else None, group=g)
                for g, (n, window) in enumerate(zip(runner.group_blocks, runner.kv_groups.windows))]
    return managers[0] if len(managers) == 1 else GroupedBlocks(managers)


class GroupedBlocks:
    def __init__(self, managers: list[BlockManager]):
        self.managers = managers
        self.block_size = managers[0].block_size

    def _per_group(self, hits: list) -> list[list[int]]:
        return hits or [[] for _ in self.managers]  # [] (no lookup: a prompt wanting its logprobs) in each

    # the first group's blocks and counters, for stats and tests
    @property
    def blocks(self):
        return self.managers[0].blocks

    @property
    def num_free_blocks(self) -> int:
        return self.managers[0].num_free_blocks

    @property
    def prefix_hits(self) -> int:
        return self.managers[0].prefix_hits

    @property
    def prefix_queries(self) -> int:
        return self.managers[0].prefix_queries

    @property
    def prefix_hits_other_version(self) -> int:
        return self.managers[0].prefix_hits_other_version

    @property
    def prefix_blocks_dropped(self) -> int:
        return self.managers[0].prefix_blocks_dropped

    # set by the core: where every group's hash chains start, and the weights' version now
    @property
    def hash_root(self) -> Callable[[Sequence], bytes]:
        return self.managers[0].hash_root

    @hash_root.setter
    def hash_root(self, hash_root: Callable[[Sequence], bytes]) -> None:
        for m in self.managers:
            m.hash_root = hash_root

    @property
    def current_version(self) -> Callable[[], int]:
        return self.managers[0].current_version

    @current_version.setter
    def current_version(self, current_version: Callable[[], int]) -> None:
        for m in self.managers:
            m.current_version = current_version

    def cached_prefix_blocks(self, seq: Sequence) -> list[list[int]]:
        """Each group's hit blocks, all as long: the full group's first (any prefix of its hit is one), then
        the windowed group's longest no longer than that (its last window's blocks cached)."""
        per, limit = [], None
        for m in self.managers:
            per.append(m.cached_prefix_blocks(seq, limit))
            limit = len(per[-1])
        return [h[:limit] for h in per]

    def cached_tokens(self, hits: list) -> int:
        return len(self._per_group(hits)[0]) * self.block_size

    def can_allocate(self, seq: Sequence, hits: list) -> bool:
        return all(m.can_allocate(seq, h) for m, h in zip(self.managers, self._per_group(hits)))

    def allocate(self, seq: Sequence, hits: list) -> None:
        for m, h in zip(self.managers, self._per_group(hits)):
            m.allocate(seq, h)

    def free_seq(self, seq: Sequence) -> None:
        for m in self.managers:
            m.free_seq(seq)

    def release_behind_window(self, seq: Sequence) -> None:
        for m in self.managers:
            m.release_behind_window(seq)

    def can_append(self, seq: Sequence) -> bool:
        return all(m.can_append(seq) for m in self.managers)

    def append_slot(self, seq: Sequence) -> None:
        for m in self.managers:
            m.append_slot(seq)

    def reset_prefix_cache(self) -> None:
        for m in self.managers:
            m.reset_prefix_cache()
