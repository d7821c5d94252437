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


def finite(logprob: float) -> float:
    """JSON has no -inf (a token masked by allowed_token_ids, bad_words or logit_bias): what vLLM writes."""
    return max(logprob, -9999.0)


class LogprobFormat:
    """Logprobs as each endpoint writes them: chat's `{"content": [{token, logprob, bytes,
    top_logprobs}]}`, completions' `{tokens, token_logprobs, top_logprobs, text_offset}`. A
    position's alternatives come from the engine as `{token id: Logprob}`: the sampled (or prompt)
    token and the k most likely."""

    def __init__(self, tokenizer, as_ids: bool = False, cache: dict[int, str] | None = None):
        self.tokenizer = tokenizer
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids: each token written "token_id:<id>"
        self._cache: dict[int, str] = {} if cache is None else cache

    def with_ids(self) -> LogprobFormat:
        """The same, tokens written as vLLM's `"token_id:<id>"` (what TRL asks for: two ids that
        decode alike stay apart)."""
        return LogprobFormat(self.tokenizer, as_ids=True, cache=self._cache)

    def text(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id])
        return s

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def chat(self, token_ids: list[int], logprobs: list[float], top: list[dict] | None, k: int) -> dict:
        """`top_logprobs` holds the k most likely (OpenAI's meaning), the sampled token only if among them."""
        content = []
        for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
            s = self.token(t)
            best = sorted(top[i].items(), key=lambda e: e[1].rank or 0)[:k] if top else ()
            alts = [{"token": self.token(a), "logprob": finite(e.logprob), "bytes": list(self.text(a).encode())}
                    for a, e in best]
            content.append({"token": s, "logprob": finite(lp), "bytes": list(self.text(t).encode()),
                            "top_logprobs": alts})
        return {"content": content}

    def completion(self, token_ids: list[int], logprobs: list[float | None], top: list[dict | None] | None,
                   offset: int = 0) -> dict:
        """`top_logprobs` per position: the token's own entry and the k most likely (up to k + 1, as
        OpenAI's); None where there is no distribution (a prompt's first token). `text_offset`
        counts each token's text from `offset`."""
        tokens = [self.token(t) for t in token_ids]
        offsets, at = [], offset
        for t in token_ids:
            offsets.append(at)
            at += len(self.text(t))
        return {"tokens": tokens, "token_logprobs": [None if v is None else finite(v) for v in logprobs],
                "top_logprobs": [None if d is None else {self.token(a): finite(e.logprob) for a, e in d.items()}
                                 for d in top] if top is not None else None,
                "text_offset": offsets}

    def text_length(self, token_ids: list[int]) -> int:
        """How far `text_offset` moves over these tokens."""
        return sum(len(self.text(t)) for t in token_ids)


def envelope(kind: str, request_id: str, model: str, choices: list[dict], **extra) -> dict:
    """A whole response or a stream chunk; `kind` is OpenAI's object name."""
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            **extra}
