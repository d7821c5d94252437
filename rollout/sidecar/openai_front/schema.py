"""The request bodies agents send, as pydantic models (a wrong type is a 400 naming the field),
and how each becomes SamplingParams. Fields OpenAI defines that we do not serve are refused when
set to anything but their default, never silently ignored; unknown fields are ignored, as vLLM
and OpenAI do. Field names, defaults and refusals follow vLLM's protocol.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine import SamplingParams
from engine.sampling_params import INT64

TokenId = Annotated[int, Field(ge=0)]
LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps each bias to [-100, 100], as OpenAI documents the range


class BadField(ValueError):
    """A value the server refuses, with the field it came in (a 400 naming it)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """What the engines take: their context, their vocabulary, the most logprobs a token reports."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int

    def check_logprobs(self, k: int | None, param: str) -> None:
        if k is not None and k > self.max_logprobs:
            raise BadField(param, f"{param}={k} is above this engine's max_logprobs ({self.max_logprobs})")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(0, ge=0)
    # token ids as JSON object keys ("50256": -100), as OpenAI's and vLLM's logit_bias
    logit_bias: dict[TokenId, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None
    return_token_ids: bool = True  # vLLM's flag; our responses always carry them
    # a mixture of experts' routing (replay): SGLang's flag and vLLM's start; each choice then carries
    # `routed_experts`, the [positions, layers, k] expert ids as base64 of their .npy bytes
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name each token "token_id:<id>" (TRL asks for it)
    # the weight version whose cached prefix this request may reuse (a multi-turn episode keeping the KV
    # it started under across pushes; SamplingParams.prefix_version); None: the version served now only
    prefix_version: int | None = Field(None, ge=0)
    user: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v, info: ValidationInfo):
        if v and not info.data.get("stream"):
            raise ValueError("stream_options can only be defined when `stream=True`")
        return v

    def check_token_ids(self, vocab_size: int) -> None:
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            bad = [t for t in getattr(self, name) or () if t >= vocab_size]  # ids are >= 0 already
            if bad:
                raise BadField(name, f"{name}: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        """Raises ValueError (a 400) for values the engine refuses."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and len(stop) > 16:
            raise BadField("stop", "stop: at most 16 strings")
        if self.min_tokens > max_tokens:
            raise BadField("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})")
        bias = None if self.logit_bias is None else {
            t: min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, b)) for t, b in self.logit_bias.items()}
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop,
                              stop_token_ids=self.stop_token_ids, seed=self.seed, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=bias,
                              allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                              return_routed_experts=self.return_routed_experts,
                              routed_experts_prompt_start=self.routed_experts_prompt_start,
                              prefix_version=self.prefix_version)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


def check_context(prompt_len: int, max_tokens: int, max_model_len: int, param: str = "max_tokens") -> None:
    """vLLM's refusal of a prompt and completion that do not fit the context together."""
    if prompt_len + max_tokens > max_model_len:
        raise BadField(param, f"This model's maximum context length is {max_model_len} tokens. However, you "
                              f"requested {max_tokens} output tokens and your prompt contains {prompt_len} input "
                              f"tokens, for a total of {prompt_len + max_tokens} tokens. Please reduce the length "
                              "of the input prompt or the number of requested output tokens.")


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = Field(None, ge=0)  # the engine's max_logprobs bounds it
    echo: bool = False
    best_of: int | None = None
    suffix: None = None

    @field_validator("max_tokens")
    @classmethod
    def _null_is_the_default(cls, v):
        return 16 if v is None else v  # as vLLM: null means the default, not "up to the context"

    def prompts(self) -> list:
        """Each prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise BadField("prompt", "prompt is empty")
        return list(p)

    def engine_params(self, prompt_lens: list[int], limits: Limits) -> SamplingParams:
        """The engine's params for these prompts. Echo with max_tokens 0 scores the prompt alone:
        one token is generated (the engine needs one) and dropped, as vLLM does."""
        if self.max_tokens == 0 and not self.echo:
            raise BadField("max_tokens", "max_tokens must be at least 1 (0 only with echo)")
        for n in prompt_lens:
            check_context(n, self.max_tokens, limits.max_model_len)
        limits.check_logprobs(self.logprobs, "logprobs")
        self.check_token_ids(limits.vocab_size)
        prompt_logprobs = self.logprobs if self.echo else None
        return self.sampling_params(max(self.max_tokens, 1), self.logprobs, prompt_logprobs)


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] | None = None  # JSON text, as OpenAI sends it (an object is taken too)


class ToolCallParam(BaseModel):
    """An assistant message's `tool_calls[i]`, as this server (or OpenAI) returned it."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ... go to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool message: the call it answers
    # The multi-turn contract: an assistant turn this server generated, sent back with the
    # completion token ids it answered (`choices[i].token_ids`), is spliced in as those exact ids.
    token_ids: list[int] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # the engine's max_logprobs bounds it
    tools: list[dict[str, Any]] | None = Field(None, min_length=1)  # [] is a 400, as OpenAI's
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info: ValidationInfo):
        if v in (None, "none"):
            return v
        if not info.data.get("tools"):
            raise ValueError("when using `tool_choice`, `tools` must be set")
        if v != "auto":  # "required" or a named function: only a tool-call parser could force one
            raise ValueError("only 'auto' and 'none' are served: this server does not constrain decoding to a "
                             "tool call (tool calls are read from the content)")
        return v

    def engine_params(self, prompt_len: int, limits: Limits) -> SamplingParams:
        """The engine's params. Without max_tokens the budget is what the prompt leaves of the
        context, as vLLM's."""
        given, param = self.max_completion_tokens, "max_completion_tokens"
        if given is None:
            given, param = self.max_tokens, "max_tokens"
        if given is not None:
            check_context(prompt_len, given, limits.max_model_len, param)
        k = self.logprobs_k()
        limits.check_logprobs(k, "top_logprobs")
        self.check_token_ids(limits.vocab_size)
        return self.sampling_params(given if given is not None else limits.max_model_len - prompt_len, k)

    def logprobs_k(self) -> int | None:
        """The engine's `logprobs`: None when not asked, else the top-k to report (0: only the sampled)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0
