"""Continuous batching: every step either prefills newly admitted sequences or decodes one token
for every running sequence. Sequences join and leave the batch between steps; when KV blocks run
out, the newest running sequence is preempted (its blocks freed) and later recomputed.

Pausing (as vLLM's `PauseState`): while paused, new sequences are held aside until `resume()`;
"draining" (pause mode "wait") keeps stepping every sequence that arrived before the pause,
queued ones included, and becomes paused once none is left."""

from __future__ import annotations

import enum
from collections import deque

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SeqStatus


class PauseState(enum.Enum):
    UNPAUSED = "unpaused"
    DRAINING = "draining"  # finishing what arrived before the pause; new sequences are held
    PAUSED = "paused"  # nothing steps; new sequences are held


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.held: deque[Sequence] = deque()  # arrived while paused; scheduled after resume()
        self.num_preemptions = 0
        self.pause_state = PauseState.UNPAUSED

    def add(self, seq: Sequence) -> None:
        (self.waiting if self.pause_state == PauseState.UNPAUSED else self.held).append(seq)

    def has_unfinished(self) -> bool:
        """Sequences that a step could advance (held ones wait for resume)."""
        return bool(self.waiting or self.running)

    # -- pausing ------------------------------------------------------------------------------
    def pause(self, drain: bool) -> None:
        """Stop stepping now, or (drain) once every sequence already admitted has finished."""
        self.pause_state = PauseState.DRAINING if drain and self.has_unfinished() else PauseState.PAUSED

    def drained(self) -> bool:
        """True once a draining pause has nothing left to finish (it is then paused)."""
        if self.pause_state == PauseState.DRAINING and not self.has_unfinished():
            self.pause_state = PauseState.PAUSED
        return self.pause_state == PauseState.PAUSED

    def resume(self) -> None:
        self.pause_state = PauseState.UNPAUSED
        self.waiting.extend(self.held)
        self.held.clear()

    def can_step(self) -> bool:
        return self.pause_state != PauseState.PAUSED and self.has_unfinished()

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick this step's sequences; returns (seqs, is_prefill). Nothing while paused."""
        if self.pause_state == PauseState.PAUSED:
            return [], False
        for seq in self.running:  # before admitting: a prefill step's prompts hold no blocks behind their windows
            self.bm.release_behind_window(seq)
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # prompt logprobs need every prompt position's logits, prompt routing its routed experts:
            # no prefix-cache hits (as vLLM for the logprobs)
            hits = [] if seq.wants_prompt_logprobs or seq.wants_prompt_routing else self.bm.cached_prefix_blocks(seq)
            new_tokens = len(seq) - self.bm.cached_tokens(hits)
            if new_tokens > budget or not self.bm.can_allocate(seq, hits):
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
                (self.held if seq in self.held else self.waiting).remove(seq)
            elif seq.status == SeqStatus.RUNNING:
                self.bm.free_seq(seq)
                self.running.remove(seq)
            seq.status = SeqStatus.FINISHED
