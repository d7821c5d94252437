"""Messages between the frontend and the engine-core process (msgpack via msgspec, no pickle).

Input (frontend -> core, ROUTER -> DEALER): AddRequest, AbortRequests, UtilityCall, Shutdown.
Output (core -> frontend, PUSH -> PULL): Ready, StepOutputs, CallResult, RequestError, Fatal.
Every utility call carries a call id and is answered by exactly one CallResult.
"""

from __future__ import annotations

from typing import Any, Literal, Union, get_args

import msgspec

from engine.errors import FAILED, INVALID, REFUSED, UNHEALTHY, EngineUnhealthyError, RefusedError
from engine.sampling_params import SamplingParams

# How a pause treats the requests in flight (vLLM's names): "abort" ends them now (finish reason
# "abort"), "wait" lets every one sent before the pause finish, "keep" freezes them in place.
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)

# Per position {token id: (logprob, rank)}; the frontend makes them vLLM's Logprob objects.
TokenLogprobs = dict[int, tuple[float, int]]


class RoutedRows(msgspec.Struct, array_like=True):
    """Rows of a sequence's routed experts: `data` the bytes of a C-ordered [rows, layers, k] array."""

    data: bytes
    layers: int
    k: int
    dtype: str  # numpy's name: "uint8" (at most 256 experts) or "int16"


class SeqDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence gained in one step."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    version: int  # weight version these tokens were sampled under
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0
    top_logprobs: list[TokenLogprobs] | None = None  # per token, when the request asked logprobs=k
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first token
    routed_experts: RoutedRows | None = None  # the rows this step added, when the request asked


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # a dataclass msgspec decodes field by field, validating it (__post_init__)


class AddRequestId(msgspec.Struct, tag="add", array_like=True):
    """An AddRequest read only as far as its id: one whose parameters do not decode is still
    answered, with a RequestError of its own."""

    request_id: str


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


EngineInput = Union[AddRequest, AbortRequests, UtilityCall, Shutdown]


class Ready(msgspec.Struct, tag="ready", array_like=True):
    pid: int
    vocab_size: int
    num_kv_blocks: int
    quantized_bytes: int = 0  # the 8-bit copy's memory beside the weights (EngineConfig.quantization)


class StepOutputs(msgspec.Struct, tag="out", array_like=True):
    deltas: list[SeqDelta]


def error_for(kind: str, text: str) -> Exception:
    """An error of `kind` as the frontend raises it (engine.errors.error_kind reads it back)."""
    if kind == REFUSED:
        return RefusedError(text)
    if kind == INVALID:
        return ValueError(text)
    return EngineUnhealthyError([text]) if kind == UNHEALTHY else RuntimeError(text)


class CallResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    ok: bool
    value: Any = None
    error: str = ""
    error_kind: str = FAILED


class RequestError(msgspec.Struct, tag="req_error", array_like=True):
    request_id: str
    error: str
    error_kind: str = FAILED


class Fatal(msgspec.Struct, tag="fatal", array_like=True):
    """The core's last word before it exits: a step failed (a CUDA error, an OOM), so nothing it
    would compute after could be trusted."""

    error: str


EngineOutput = Union[Ready, StepOutputs, CallResult, RequestError, Fatal]
