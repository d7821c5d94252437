"""Continuous batching: every step either prefills newly admitted sequences or decodes one token
for every running sequence. Sequences join and leave the batch between steps; when KV blocks run
out, the newest running sequence is preempted (its blocks freed) and later recomputed."""

from __future__ import annotations

from collections import deque

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SeqStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.admit_new = True  # False while draining: only preempted sequences may (re)start

    def has_in_flight(self) -> bool:
        """Running sequences, or preempted ones waiting to be recomputed."""
        return bool(self.running) or any(s.num_output_tokens for s in self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick this step's sequences; returns (seqs, is_prefill)."""
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.admit_new and seq.num_output_tokens == 0:
                break
            hits = self.bm.cached_prefix_blocks(seq)
            new_tokens = len(seq) - len(hits) * self.bm.block_size
            if new_tokens > budget or self.bm.blocks_needed(seq, hits) > self.bm.num_free_blocks:
                break
            self.waiting.popleft()
            self.bm.allocate(seq, hits)
            if seq.num_output_tokens == 0:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            budget -= new_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True

        decoding: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.bm.append_slot(seq)
                decoding.append(seq)
        self.running.extend(decoding)
        return decoding, False

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the blocks and put the sequence (prompt + tokens so far) first in line."""
        self.num_preemptions += 1
        self.bm.free_seq(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.bm.free_seq(seq)
        self.running.remove(seq)

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.status == SeqStatus.WAITING:
                self.waiting.remove(seq)
            elif seq.status == SeqStatus.RUNNING:
                self.bm.free_seq(seq)
                self.running.remove(seq)
            seq.status = SeqStatus.FINISHED
