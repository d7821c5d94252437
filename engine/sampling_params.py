"""Sampling parameters, with vLLM's names and meanings."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MAX_LOGPROBS = 20  # vLLM's default cap on top logprobs per token


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0: off
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or output; 1: off
    presence_penalty: float = 0.0  # subtracted once from the logit of each token in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None  # per-request seed: same seed, same output, whatever shares the batch
    logprobs: int | None = None  # k > 0: also the k most likely tokens' logprobs per step (.top_logprobs)
    prompt_logprobs: int | None = None  # 0: each prompt token's logprob; k > 0: plus the top k
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"  # streaming kind for AsyncEngine: "delta" | "cumulative" | "final"
    detokenize: bool = True  # False: outputs carry token ids only, text "" (a caller that decodes itself)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"{name} must be a number, got {v!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive int, got {self.top_k!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.output_kind not in ("delta", "cumulative", "final"):
            raise ValueError(f"output_kind must be 'delta', 'cumulative' or 'final', got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        return cls(**d)
