"""POST /v1/completions as OpenAI's legacy API and vLLM's serving_completion shape it, `echo`
included: the prompt's text before the choice's, and with `logprobs` the prompt's tokens first
in `tokens`, `token_logprobs`, `top_logprobs` and `text_offset` (the first token's logprob null).
Eval harnesses score a prompt that way (`echo` + `logprobs`, `max_tokens` 0 or 1)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine import SamplingParams
from rollout.sidecar.openai_front.generation import Choice, choice_deltas, routed_experts_b64
from rollout.sidecar.openai_front.responses import envelope, usage
from rollout.sidecar.openai_front.schema import CompletionRequest


@dataclass
class _Shown:
    """How much of a choice went out already (a stream sends the rest as it comes)."""

    tokens: int = 0
    chars: int = 0
    offset: int = 0  # the next token's text_offset
    opened: bool = False


class Completions:
    """One request: its prompts, its params, and its choices written as OpenAI's."""

    def __init__(self, front, req: CompletionRequest):
        manager = front.manager
        self.front, self.req = front, req
        raw = req.prompts()
        self.prompts = [manager.prepare_prompt(p) for p in raw]
        self.params: SamplingParams = req.engine_params([len(p) for p in self.prompts], front.limits)
        front.check(self.params)
        # echo writes a text prompt as sent, token ids as they decode (vLLM's detokenized prompt)
        self.prompt_texts = [p if isinstance(p, str) else manager.tokenizer.decode(p) for p in raw] if req.echo else []
        self.scores_only = req.echo and req.max_tokens == 0  # the one token generated is not shown

    def _echo(self, c: Choice) -> tuple[list[int], list[float | None], list[dict | None]]:
        """The prompt's (token ids, logprobs, alternatives); its first token has no distribution."""
        ids = c.prompt_ids
        per_token = c.prompt_logprobs or [None] * len(ids)
        return ids, [None if d is None else d[t].logprob for t, d in zip(ids, per_token)], list(per_token)

    def ready(self, c: Choice) -> bool:
        """Whether the choice can go out: an echo with logprobs waits for the prompt's."""
        return (not self.req.echo or self.req.logprobs is None or c.prompt_logprobs is not None
                or c.finish_reason is not None)

    def piece(self, c: Choice, shown: _Shown | None = None) -> dict:
        """The choice's text, tokens and logprobs not shown yet: all of it for a whole response."""
        shown = shown or _Shown()
        k = shown.tokens
        ids = [] if self.scores_only else c.token_ids[k:]
        text = "" if self.scores_only else c.text.sent[shown.chars:]
        lps, top = c.logprobs[k:k + len(ids)], None if c.top_logprobs is None else c.top_logprobs[k:k + len(ids)]
        finish = c.finish_reason and ("length" if self.scores_only else c.finish_reason)
        out = {"index": c.index, "text": text, "finish_reason": finish, "logprobs": None, "token_ids": ids,
               "weight_versions": c.weight_versions[k:k + len(ids)]}
        scored = ids
        if not shown.opened:
            out["prompt_token_ids"] = c.prompt_ids
            if self.req.echo:
                p_ids, p_lps, p_top = self._echo(c)
                out["text"] = self.prompt_texts[c.index // self.params.n] + text
                scored, lps, top = p_ids + ids, p_lps + lps, p_top + (top or [])
        if self.req.logprobs is not None:
            fmt = self.front.fmt.with_ids() if self.req.return_tokens_as_token_ids else self.front.fmt
            out["logprobs"] = fmt.completion(scored, lps, top, shown.offset)
        if self.params.return_routed_experts and c.finish_reason is not None:  # whole, at the end, as vLLM's
            out["routed_experts"] = routed_experts_b64(c)
        shown.tokens, shown.chars, shown.opened = len(c.token_ids), len(c.text.sent), True
        shown.offset += self.front.fmt.text_length(scored)
        return out

    def generated(self, choices: list[Choice]) -> int:
        return 0 if self.scores_only else sum(len(c.token_ids) for c in choices)

    def whole(self, rid: str, choices: list[Choice]) -> dict:
        return envelope("text_completion", rid, self.front.model, [self.piece(c) for c in choices],
                        usage=usage(sum(map(len, self.prompts)), self.generated(choices)))

    async def chunks(self, rid: str) -> AsyncIterator[dict]:
        front, t0 = self.front, time.monotonic()
        first_token = True
        shown: dict[int, _Shown] = {}
        last: dict[int, Choice] = {}
        async for c, d, _ in choice_deltas(front.manager, self.prompts, self.params):
            if first_token and d.token_ids:
                front.metrics.first_token(time.monotonic() - t0)
                first_token = False
            last[c.index] = c
            if self.ready(c):
                piece = self.piece(c, shown.setdefault(c.index, _Shown()))
                yield envelope("text_completion", rid, front.model, [piece])
        if self.req.include_usage:
            yield envelope("text_completion", rid, front.model, [],
                           usage=usage(sum(map(len, self.prompts)), self.generated(list(last.values()))))
