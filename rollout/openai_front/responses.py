"""OpenAI's response shapes (completions, chat, their stream chunks, errors), plus what a trainer
needs that OpenAI does not carry: `prompt_token_ids` (top level, vLLM's name), and per choice
`token_ids` (vLLM's name) and `weight_versions` (the weight version each token came from)."""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class LogprobFormat:
    """Logprobs as each endpoint writes them: chat's `{"content": [{token, logprob, bytes,
    top_logprobs}]}`, completions' `{tokens, token_logprobs, top_logprobs, text_offset}`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id])
        return s

    def chat(self, token_ids: list[int], logprobs: list[float], top: list[dict] | None) -> dict:
        content = []
        for k, (t, lp) in enumerate(zip(token_ids, logprobs)):
            s = self.token(t)
            alts = [{"token": self.token(a), "logprob": v, "bytes": list(self.token(a).encode())}
                    for a, v in (top[k].items() if top else ())]
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": alts})
        return {"content": content}

    def completion(self, token_ids: list[int], logprobs: list[float], top: list[dict] | None,
                   offset: int = 0) -> dict:
        tokens = [self.token(t) for t in token_ids]
        offsets, at = [], offset
        for s in tokens:
            offsets.append(at)
            at += len(s)
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [{self.token(a): v for a, v in d.items()} for d in top] if top else None,
                "text_offset": offsets}


def envelope(kind: str, request_id: str, model: str, choices: list[dict], **extra) -> dict:
    """A whole response or a stream chunk; `kind` is OpenAI's object name."""
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            **extra}
