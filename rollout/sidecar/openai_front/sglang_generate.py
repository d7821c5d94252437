"""SGLang's native POST /generate (python/sglang/srt/managers/io_struct.py `GenerateReqInput`), served by the
same manager and engines as the OpenAI routes: `text` or `input_ids` (one prompt or a batch),
`sampling_params` (SGLang's names: max_new_tokens, min_new_tokens, sampling_seed, ...; a field this
sidecar does not know is ignored, as SGLang's callers expect; a known one of the wrong type is a 400
naming it), `return_logprob`, `stream`. Each answer is SGLang's: `text`, `output_ids` and `meta_info`
(`id`, `finish_reason` {"type", "matched" | "length"}, `prompt_tokens`, `completion_tokens`,
`cached_tokens`, `weight_version`, with `return_logprob` `output_token_logprobs` as [logprob, token_id,
null] triples), plus ours: `weight_versions`, one per token. A stream sends `data: {...}` lines as SGLang
does by default (text, ids and logprobs so far in each), then `data: [DONE]`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from engine import SamplingParams
from rollout.sidecar.openai_front.generation import Choice, choice_deltas, routed_experts_b64

# SGLang's sampling field -> (ours, the JSON types it takes)
_NUM = (int, float)
_FIELDS = {"max_new_tokens": ("max_tokens", int), "min_new_tokens": ("min_tokens", int),
           "temperature": ("temperature", _NUM), "top_p": ("top_p", _NUM), "top_k": ("top_k", int),
           "min_p": ("min_p", _NUM), "frequency_penalty": ("frequency_penalty", _NUM),
           "presence_penalty": ("presence_penalty", _NUM), "repetition_penalty": ("repetition_penalty", _NUM),
           "stop": ("stop", (str, list)), "stop_token_ids": ("stop_token_ids", list), "ignore_eos": ("ignore_eos", bool),
           "n": ("n", int), "sampling_seed": ("seed", int), "no_stop_trim": ("include_stop_str_in_output", bool),
           "logit_bias": ("logit_bias", dict)}
_IGNORED_BOOLS = ("skip_special_tokens", "spaces_between_special_tokens")  # text decoding options: ours decodes one way


class BadField(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def sampling_params(body: dict) -> SamplingParams:
    raw = body.get("sampling_params") or {}
    if not isinstance(raw, dict):
        raise BadField("sampling_params", "a batch with one sampling_params per prompt is not taken: send one object")
    kwargs = {"max_tokens": 128}  # SGLang's default max_new_tokens
    for key, value in raw.items():
        if key in _IGNORED_BOOLS and not isinstance(value, bool):
            raise BadField(f"sampling_params.{key}", f"expected a boolean, got {value!r}")
        if key not in _FIELDS or value is None:
            continue
        ours, kind = _FIELDS[key]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise BadField(f"sampling_params.{key}", f"expected {getattr(kind, '__name__', 'a number')}, got {value!r}")
        kwargs[ours] = value
    if "return_routed_experts" in body:  # SGLang's request field (not a sampling parameter)
        if not isinstance(body["return_routed_experts"], bool):
            raise BadField("return_routed_experts", f"expected a boolean, got {body['return_routed_experts']!r}")
        kwargs["return_routed_experts"] = body["return_routed_experts"]
    top_logprobs = body.get("top_logprobs_num")
    if body.get("return_logprob") and isinstance(top_logprobs, int) and top_logprobs > 0:
        kwargs["logprobs"] = top_logprobs
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise BadField("sampling_params", str(e)) from None


def prompts_of(body: dict, manager) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the request is a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadField("text", "send exactly one of text and input_ids")
    if text is not None:
        if isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text)):
            batch = isinstance(text, list)
            return [manager.prepare_prompt(t) for t in (text if batch else [text])], batch
        raise BadField("text", f"expected a string or a list of strings, got {type(text).__name__}")
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return [manager.prepare_prompt(list(ids))], False
    if isinstance(ids, list) and ids and all(isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p) for p in ids):
        return [manager.prepare_prompt(list(p)) for p in ids], True
    raise BadField("input_ids", "expected a list of token ids or a list of such lists")


class SglangGenerate:
    """One /generate request: its prompts and params, its answers in SGLang's shape."""

    def __init__(self, front, body: dict):
        if not isinstance(body, dict):
            raise BadField("body", "expected a JSON object")
        for key in ("return_logprob", "stream"):
            if not isinstance(body.get(key, False), bool):
                raise BadField(key, f"expected a boolean, got {body[key]!r}")
        self.front, self.body = front, body
        self.prompts, self.batch = prompts_of(body, front.manager)
        self.params = sampling_params(body)
        front.check(self.params)
        self.logprobs = body.get("return_logprob", False)
        self.rid = body.get("rid") if isinstance(body.get("rid"), str) else uuid.uuid4().hex
        self.t0 = time.monotonic()

    def answer(self, c: Choice) -> dict:
        meta = {"id": self.rid if not self.batch and self.params.n == 1 else f"{self.rid}-{c.index}",
                "finish_reason": self._finish(c), "prompt_tokens": len(c.prompt_ids),
                "completion_tokens": len(c.token_ids), "cached_tokens": 0,
                "weight_version": str(c.weight_versions[-1] if c.weight_versions else self.front.manager.version),
                "weight_versions": list(c.weight_versions), "e2e_latency": time.monotonic() - self.t0}
        if self.logprobs:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
        if self.params.return_routed_experts:
            meta["routed_experts"] = routed_experts_b64(c)
        return {"text": c.text.sent, "output_ids": list(c.token_ids), "meta_info": meta}

    def _finish(self, c: Choice) -> dict | None:
        if c.finish_reason is None:
            return None
        if c.finish_reason == "length":
            return {"type": "length", "length": len(c.token_ids)}
        if c.finish_reason == "stop":
            return {"type": "stop", "matched": c.token_ids[-1] if c.token_ids else None}
        return {"type": c.finish_reason, "message": f"request {c.finish_reason}"}

    def whole(self, choices: list[Choice]) -> dict | list[dict]:
        out = [self.answer(c) for c in choices]
        return out if self.batch or self.params.n > 1 else out[0]

    async def chunks(self) -> AsyncIterator[dict]:
        async for c, _, _ in choice_deltas(self.front.manager, self.prompts, self.params):
            chunk = self.answer(c)
            if self.batch or self.params.n > 1:
                chunk["index"] = c.index
            yield chunk
