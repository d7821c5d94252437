"""One sampled sequence (one of a request's n) and its scheduling state."""

from __future__ import annotations

import enum
import itertools

from engine.kv_groups import MAX_GROUPS
from engine.seeded_draws import seed_key
from engine.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams, block_size: int
    ):
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.params = params
        self.block_size = block_size
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_prompt_tokens = 0  # prompt tokens served by the prefix cache, first schedule
        # per KV cache group (engine/kv_groups.py; block_table: the first's) its blocks, and how many of its
        # first ones went back behind a sliding window (engine/block_manager.py)
        self.tables: list[list[int]] = [[] for _ in range(MAX_GROUPS)]
        self.released = [0] * MAX_GROUPS
        self.status = SeqStatus.WAITING
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        # the first position whose routed experts are still to be returned (return_routed_experts):
        # a recompute after preemption returns none twice, and keeps those the tokens were sampled under
        self.routed_from = params.routed_experts_prompt_start
        self.lora_version: int | None = None  # the adapter version it decodes with (engine/lora_bank.py)
        self.prefix_root: bytes | None = None  # where its block hashes chain from (engine/block_manager.py)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop_check_from = 0  # output-text offset before which no stop string can start
        # set by EngineCore.add_request: tokens banned while shorter than min_tokens (EOS unless
        # ignore_eos, stop_token_ids), and the bad words as token sequences
        self.min_tokens_bans: tuple[int, ...] = ()
        self.bad_words: list[list[int]] = []
        # the key of this sample's noise stream (sample i of n uses seed + i, as vLLM): see
        # engine/sampler.counter_uniforms; None without a seed (the shared generator's draws)
        self.seed_key: int | None = None if params.seed is None else seed_key(params.seed + index)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        return self.tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.tables[0] = table

    @property
    def num_released_blocks(self) -> int:
        return self.released[0]

    def share_table(self, table: list[int]) -> None:
        """The same blocks in every group (a scratch cache's or a scoring pass's, never the block managers')."""
        self.tables = [table] * MAX_GROUPS

    @property
    def wants_prompt_routing(self) -> bool:
        """Asked for its prompt's routed experts and not had them yet: its prompt must be computed
        here, not served from the prefix cache."""
        return self.params.return_routed_experts and self.routed_from < self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not computed them yet (a preempted sequence's
        recompute has output tokens and needs none). Sample 0 of n computes them for the request."""
        return self.params.prompt_logprobs is not None and self.index == 0 and self.num_output_tokens == 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
