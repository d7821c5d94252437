"""Request outputs, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Logprob:
    """One token's entry in `top_logprobs` / `prompt_logprobs` (vLLM's `vllm.logprobs.Logprob`):
    its logprob, its rank in that distribution (1 = most likely), its text alone (None when the
    request asked for no detokenizing)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: {token id: Logprob}, the sampled (or prompt) token and the k most likely
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token (see docs/guides/engine.md: which distribution)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    weight_versions: list[int] = field(default_factory=list)  # weight version each token was sampled under
    # logprobs=k (0 included): per token {id: Logprob} of the sampled token and the k most likely,
    # from the distribution .logprobs come from (vLLM folds these into .logprobs; ours keeps
    # .logprobs a plain list of floats, the trainer's path)
    top_logprobs: list[PositionLogprobs] | None = None
    # return_routed_experts: [rows, MoE layers, k] expert ids (uint8, int16 past 256 experts), one row a
    # position from routed_experts_prompt_start to the last sampled token's (which no forward took);
    # the rows of a prompt were computed under weight_versions[0], the row of output token i under
    # weight_versions[i + 1] (routed_experts_versions)
    routed_experts: np.ndarray | None = None
    routed_experts_versions: list[int] | None = None

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))

    @property
    def finished(self) -> bool:
        """A field-like property, as `RequestOutput.finished` (vLLM has a method here)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # prompt_logprobs=k: per prompt token {its id: Logprob, plus the top k} under the model's raw
    # distribution, None for the first token (vLLM's shape)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
