"""Paged KV-cache bookkeeping with prefix caching (after nano-vllm's block manager).

A block holds `block_size` tokens. A full block gets a hash chained on its predecessor's, so
the same prefix always hashes the same: the n samples of a GRPO group, repeated prompts and
resubmitted rollouts share the prompt's blocks (ref-counted). Freed blocks keep their hash and
contents until they are handed out again, so a later request can still hit them.

Every chain starts from the weight version its sequence's KV is computed under (`version`, fixed
when the sequence is allocated), so a push drops nothing: KV of version v serves requests under v,
never a request under v + 1 (issue 65 item 5), and the old version's blocks age out of the free
list as any other. A request may ask for an older version's prefix (`SamplingParams.prefix_version`:
a multi-turn episode keeping the KV it started under); `prefix_hits_other_version` counts those
tokens, 0 unless asked.

A model whose every layer has a sliding window of W keys (`window`) never reads a sequence's keys
more than W behind its newest: as it decodes, the blocks wholly behind that go back to the free list
(still cached, as a finished sequence's) and its table points at `spare` there instead, a block
outside the manager's that attention reads but never sees (behind the window). A sequence then holds
about W / block_size + 1 blocks however long it grows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from collections import OrderedDict

import numpy as np

from engine.sequence import Sequence


def block_hash(prev_hash: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(prev_hash + np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=16).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, spare: int | None = None, group: int = 0):
        if window is not None and spare is None:
            raise ValueError("a window needs a spare block for the table entries it releases")
        self.block_size = block_size
        self.group = group  # the KV cache group whose blocks it hands out: each sequence's table in it (seq.tables)
        self.window, self.spare = window, spare
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Where a sequence's hash chain starts: b"" unless unmerged LoRA adapters are in use, where
        # KV computed under one adapter version must never serve another (the core sets it)
        self.hash_root: Callable[[Sequence], bytes] = lambda seq: b""
        self.hash_to_block: dict[bytes, int] = {}
        # Free blocks in LRU order: the least recently freed is handed out (and its hash evicted) first.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.prefix_hits = 0  # tokens served from cache
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits_other_version = 0  # of the hits, tokens computed under another version (asked for)
        self.prefix_blocks_dropped = 0  # cached blocks forgotten by reset_prefix_cache
        # the weights' version now, the key of the chains allocated from now on (the core reads its worker's)
        self.current_version: Callable[[], int] = lambda: 0

    @property
    def version(self) -> int:
        return self.current_version()

    def _key_version(self, seq: Sequence) -> int:
        asked = seq.params.prefix_version
        return self.version if asked is None else asked

    def _root(self, seq: Sequence) -> bytes:
        """Where `seq`'s chain starts: fixed at its allocation, else the version its KV would be keyed
        under now (and hash_root's part)."""
        return seq.prefix_root or self.hash_root(seq) + b"v:%d" % self._key_version(seq)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def _take_free(self, block_id: int | None = None) -> Block:
        if block_id is None:
            block_id, _ = self.free.popitem(last=False)
        else:
            del self.free[block_id]
        return self.blocks[block_id]

    def _fresh(self) -> Block:
        block = self._take_free()
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = None, [], 1
        return block

    def _register(self, seq: Sequence, i: int) -> None:
        """Hash full block i of `seq` and make it findable, if the chain before it is intact."""
        table = seq.tables[self.group]
        if 0 < i <= seq.released[self.group]:  # its predecessor went back (a window of at most a block)
            return
        prev = self.blocks[table[i - 1]].hash if i > 0 else self._root(seq)
        if prev is None:  # the chain was cut by a prefix-cache reset
            return
        block, tokens = self.blocks[table[i]], seq.block_tokens(i)
        block.hash, block.token_ids = block_hash(prev, tokens), tokens
        if self.enable_prefix_caching:
            self.hash_to_block[block.hash] = block.block_id

    def cached_prefix_blocks(self, seq: Sequence, limit: int | None = None) -> list[int]:
        """Block ids that already hold a prefix of `seq` (always leaving >= 1 token to compute), at most
        `limit` blocks. Under a window only the blocks the first token computed reads need be cached, and
        those before it are the spare (as vLLM's sliding-window manager): the first blocks of a long
        prefix go back early and are handed out first, so a hit from block 0 on would seldom last."""
        if not self.enable_prefix_caching:
            return []
        found, h = [], self._root(seq)
        whole = (len(seq) - 1) // self.block_size  # blocks before the one holding the last token
        for i in range(whole if limit is None else min(whole, limit)):
            tokens = seq.block_tokens(i)
            h = block_hash(h, tokens)
            bid = self.hash_to_block.get(h)
            cached = bid is not None and self.blocks[bid].token_ids == tokens
            if not cached and self.window is None:
                break
            found.append(bid if cached else None)
        if self.window is None:
            return found
        missed, misses = -1, []  # misses[n]: the last block of found[:n] not cached (-1: none)
        for i, bid in enumerate(found):
            misses.append(missed)
            missed = i if bid is None else missed
        misses.append(missed)
        for n in range(len(found), 0, -1):  # the longest prefix whose last window's blocks are all here
            first = max(0, n * self.block_size - self.window + 1) // self.block_size
            if misses[n] < first:
                return [self.spare] * first + found[first:n]
        return []

    def blocks_needed(self, seq: Sequence, hits: list[int]) -> int:
        """Free blocks an allocation would consume (hit blocks sitting in the free list count too)."""
        return seq.num_blocks - len(hits) + sum(1 for b in hits if b != self.spare and self.blocks[b].ref_count == 0)

    def cached_tokens(self, hits: list[int]) -> int:
        return len(hits) * self.block_size

    def can_allocate(self, seq: Sequence, hits: list[int]) -> bool:
        return self.blocks_needed(seq, hits) <= self.num_free_blocks

    def allocate(self, seq: Sequence, hits: list[int]) -> None:
        table = seq.tables[self.group]
        assert not table
        seq.prefix_root = None  # (a preempted sequence computes its KV again, under the version now)
        seq.prefix_root = self._root(seq)  # fixed: its later blocks chain from the version it starts under
        seq.released[self.group] = sum(1 for bid in hits if bid == self.spare)  # behind the window already
        for bid in hits:
            table.append(bid)
            if bid == self.spare:
                continue
            block = self.blocks[bid]
            if block.ref_count == 0:
                self._take_free(bid)
            block.ref_count += 1
        for i in range(len(hits), seq.num_blocks):
            block = self._fresh()
            table.append(block.block_id)
            if (i + 1) * self.block_size <= len(seq):
                # Registered now, computed in this same step: the runner writes every sequence's
                # KV of a layer before any attention of that layer reads the cache.
                self._register(seq, i)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.prefix_queries += len(seq)
        self.prefix_hits += seq.num_computed_tokens
        if self._key_version(seq) != self.version:
            self.prefix_hits_other_version += seq.num_computed_tokens

    def free_seq(self, seq: Sequence) -> None:
        g = self.group
        for bid in reversed(seq.tables[g][seq.released[g]:]):  # tail first: prefixes stay cached longest
            self._drop(bid)
        seq.tables[g] = []
        seq.released[g] = seq.num_computed_tokens = 0
        seq.prefix_root = None  # a preempted sequence looks up (and computes) its KV under the version then

    def _drop(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[bid] = None

    def release_behind_window(self, seq: Sequence) -> None:
        """Hand back the blocks wholly behind the window of `seq`'s newest token, the next query (its
        keys j > len - 1 - window): block i ends at key (i + 1) * block_size - 1."""
        if self.window is None:
            return
        behind, g = (len(seq) - self.window) // self.block_size, self.group
        table = seq.tables[g]
        for i in range(seq.released[g], behind):
            self._drop(table[i])
            table[i] = self.spare
        seq.released[g] = max(seq.released[g], behind)

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of the newest token (the one the next decode step feeds in)?"""
        return len(seq) <= len(seq.tables[self.group]) * self.block_size or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        table = seq.tables[self.group]
        if len(seq) > len(table) * self.block_size:
            table.append(self._fresh().block_id)
        if len(seq) % self.block_size == 0:  # the last block is now full: make it shareable
            self._register(seq, len(seq) // self.block_size - 1)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update the cached KV is stale). Blocks of
        running sequences lose their hash too, so nothing computed before the reset is shared."""
        self.prefix_blocks_dropped += len(self.hash_to_block)
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, []
