"""Request outputs, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token (see README: which distribution)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    weight_versions: list[int] = field(default_factory=list)  # weight version each token was sampled under
    # logprobs=k: per token, the k most likely tokens {id: logprob} of the distribution .logprobs
    # come from (vLLM folds these into .logprobs; ours keeps .logprobs a plain list of floats)
    top_logprobs: list[dict[int, float]] | None = None

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
    # prompt_logprobs=k: per prompt token {its id: logprob, plus the top k} under the model's raw
    # distribution, None for the first token (vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None
