"""Sampling parameters, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None  # per-request seed: same seed, same output, whatever shares the batch
    logprobs: int | None = None  # 0 / None: the sampled token's logprob (always returned); k > 0 not supported yet
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"  # streaming kind for AsyncEngine: "delta" | "cumulative" | "final"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
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
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative int or None, got {self.logprobs!r}")
        if self.logprobs:  # never silently ignored (DESIGN): top-k logprobs per token are not built yet
            raise ValueError(f"logprobs={self.logprobs}: top-k logprobs per token are not supported yet; the "
                             "sampled token's logprob is always in .logprobs (logprobs=0 or None)")
        if self.output_kind not in ("delta", "cumulative", "final"):
            raise ValueError(f"output_kind must be 'delta', 'cumulative' or 'final', got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        return cls(**d)
