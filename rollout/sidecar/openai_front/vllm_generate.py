"""vLLM's token-in token-out POST /inference/v1/generate (vllm/entrypoints/scale_out/token_in_token_out), served
by the same manager and engines as the OpenAI routes: `token_ids` and vLLM's `sampling_params` (its field names
are ours; one this sidecar does not know is ignored, as vLLM's msgspec struct would take it; a known one of the
wrong kind is a 400 naming it), `stream`, `request_id`, `return_token_ids`. `output_mode` "tokens" only (the
default; "text" is refused by name). Each choice is vLLM's `GenerateTokensChoice`: `index`, `finish_reason`,
`token_ids`, `logprobs` ({"content": [{"token_id", "logprob"}]} when `sampling_params.logprobs` is set),
`weight_versions` as vLLM's spans ({"version", "start", "end"} over output-token indexes), `routed_experts`
(base64 `.npy`, when `return_routed_experts`). A stream sends `GenerateTokensStreamResponse` chunks (each
choice's new tokens), then `data: [DONE]`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from engine import SamplingParams
from rollout.sidecar.openai_front.generation import Choice, choice_deltas, routed_experts_b64
from rollout.sidecar.openai_front.sglang_generate import BadField

_REFUSED = ("features", "content_parts", "kv_transfer_params", "ec_transfer_params")  # multimodal, disaggregation


def sampling_params(raw) -> SamplingParams:
    if not isinstance(raw, dict):
        raise BadField("sampling_params", "expected an object of vLLM's SamplingParams fields")
    known = {k: v for k, v in raw.items() if k in SamplingParams.__dataclass_fields__ and v is not None}
    known.pop("output_kind", None)  # how vLLM's engine streams: the route decides here
    try:
        return SamplingParams(**known)
    except (TypeError, ValueError) as e:
        raise BadField("sampling_params", str(e)) from None


def spans(versions: list[int], start: int = 0) -> list[dict]:
    """vLLM's weight-version spans: [start, end) output-token indexes per version, in order."""
    out: list[dict] = []
    for k, v in enumerate(versions, start):
        if out and out[-1]["version"] == str(v):
            out[-1]["end"] = k + 1
        else:
            out.append({"version": str(v), "start": k, "end": k + 1})
    return out


class VllmGenerate:
    """One /inference/v1/generate request: its prompt and params, its answers in vLLM's shape."""

    def __init__(self, front, body):
        if not isinstance(body, dict):
            raise BadField("body", "expected a JSON object")
        ids = body.get("token_ids")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in ids)):
            raise BadField("token_ids", "expected a non-empty list of token ids")
        if body.get("output_mode", "tokens") != "tokens":
            raise BadField("output_mode", "this sidecar serves output_mode 'tokens' only (ids, logprobs, versions)")
        for key in _REFUSED:
            if body.get(key):
                raise BadField(key, "multimodal inputs and disaggregated serving are not served here")
        for key in ("stream", "return_token_ids"):
            if not isinstance(body.get(key) or False, bool):
                raise BadField(key, f"expected a boolean, got {body[key]!r}")
        self.front, self.body = front, body
        self.prompts = [front.manager.prepare_prompt(list(ids))]
        self.params = sampling_params(body.get("sampling_params") or {})
        front.check(self.params)
        self.rid = body.get("request_id") if isinstance(body.get("request_id"), str) else uuid.uuid4().hex
        self.created = int(time.time())

    def _choice(self, c: Choice, start: int = 0, whole: bool = True) -> dict:
        ids, lps = c.token_ids[start:], c.logprobs[start:]
        out = {"index": c.index, "finish_reason": c.finish_reason if not whole else c.finish_reason or "stop",
               "token_ids": ids, "weight_versions": spans(c.weight_versions[start:], start),
               "logprobs": None, "routed_experts": None}
        if self.params.logprobs is not None:
            out["logprobs"] = {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps)]}
        if self.params.return_routed_experts and (whole or c.finish_reason is not None):
            out["routed_experts"] = routed_experts_b64(c)
        return out

    def _head(self) -> dict:
        return {"request_id": self.rid, "model": self.front.model, "created": self.created, "output_mode": "tokens"}

    def whole(self, choices: list[Choice]) -> dict:
        prompt = choices[0].prompt_ids
        out = {**self._head(), "choices": [self._choice(c) for c in choices],
               "usage": {"prompt_tokens": len(prompt), "completion_tokens": sum(len(c.token_ids) for c in choices),
                         "total_tokens": len(prompt) + sum(len(c.token_ids) for c in choices)}}
        if self.body.get("return_token_ids"):
            out["prompt_token_ids"] = list(prompt)
        return out

    async def chunks(self) -> AsyncIterator[dict]:
        sent: dict[int, int] = {}  # choice index -> its tokens sent so far
        first = True
        async for c, _, _ in choice_deltas(self.front.manager, self.prompts, self.params):
            start = sent.get(c.index, 0)
            sent[c.index] = len(c.token_ids)
            chunk = {**self._head(), "choices": [self._choice(c, start, whole=False)]}
            if first and self.body.get("return_token_ids"):
                chunk["prompt_token_ids"] = list(c.prompt_ids)
            first = False
            yield chunk
