"""Sampling parameters, with vLLM's names and meanings."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MAX_LOGPROBS = 20  # vLLM's default cap on top logprobs per token (EngineConfig.max_logprobs)
INT64 = (-(2**63), 2**63 - 1)  # a seed's range: torch's generators, msgpack and vLLM's API take int64


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
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings unchecked, until this many tokens
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None  # per-request seed: same seed, same output, whatever shares the batch
    logprobs: int | None = None  # k >= 0: .top_logprobs per step, the sampled token's and the k most likely
    prompt_logprobs: int | None = None  # 0: each prompt token's logprob; k > 0: plus the top k
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # {token id: bias} added to the logits before sampling
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words that may not be generated (each a token sequence, vLLM's rule)
    output_kind: str = "cumulative"  # streaming kind for AsyncEngine: "delta" | "cumulative" | "final"
    # mixtures of experts (routing replay): each token's top-k expert ids per MoE layer come back
    # in CompletionOutput.routed_experts, [tokens, layers, k] (SGLang's and vLLM's names), the prompt's
    # from routed_experts_prompt_start on (vLLM's: 0, the whole prompt; the prompt's length: none of it)
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = 0
    detokenize: bool = True  # False: outputs carry token ids only, text "" (a caller that decodes itself)
    # the weight version whose cached prefix this request may reuse: a multi-turn episode keeping the
    # KV of the version it started under across pushes (miles' session prefix); None: only the
    # blocks computed under the version the engine serves now (engine/block_manager.py)
    prefix_version: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:  # JSON and msgpack-from-JSON give string keys
            self.logit_bias = {_token_id(k, "logit_bias"): v for k, v in self.logit_bias.items()}
        self._validate()
        self._validate_processors()

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
        if self.seed is not None and (not isinstance(self.seed, int) or not INT64[0] <= self.seed <= INT64[1]):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**63 - 1], got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {k!r}")
        v = self.prefix_version
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"prefix_version must be None or an int >= 0 (a weight version), got {v!r}")
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts must be a bool, got {self.return_routed_experts!r}")
        start = self.routed_experts_prompt_start
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"routed_experts_prompt_start must be an int >= 0, got {start!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.output_kind not in ("delta", "cumulative", "final"):
            raise ValueError(f"output_kind must be 'delta', 'cumulative' or 'final', got {self.output_kind!r}")

    def _validate_processors(self) -> None:
        """The logits processors' fields; ids are checked against the vocabulary by the engine,
        which knows it (EngineCore.add_request)."""
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for k, v in (self.logit_bias or {}).items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"logit_bias[{k}] must be a finite number, got {v!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            self.allowed_token_ids = [_token_id(t, "allowed_token_ids") for t in self.allowed_token_ids]
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        for t in self.stop_token_ids:
            if t < 0:
                raise ValueError(f"stop_token_ids must be token ids (>= 0), got {t}")

    def token_ids_outside(self, vocab_size: int) -> str | None:
        """What names a token id outside [0, vocab_size), or None when every id is inside."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
                          ("logit_bias", list(self.logit_bias or ()))):
            bad = [t for t in ids or () if not 0 <= t < vocab_size]
            if bad:
                return f"{name} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        return None

    def bad_words_token_ids(self, tokenizer) -> list[list[int]]:
        """Each bad word as the token sequences that spell it, alone and after a space (vLLM's
        rule: the spaced form counts when it starts with another token and is as long)."""
        out: list[list[int]] = []
        for word in self.bad_words or ():
            bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return out

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


def _token_id(t, field: str) -> int:
    try:
        if isinstance(t, bool) or isinstance(t, float):
            raise ValueError
        return int(t)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: token ids must be ints, got {t!r}") from None
