"""POST /v1/chat/completions: the messages through the chat template (rollout.sidecar.openai_front.chat_prompt),
the choices as OpenAI's chat completion or its stream of chunks, tool calls read out of them when the
request asks and the server can (rollout.sidecar.openai_front.chat_tools)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from rollout.sidecar.openai_front import chat_tools
from rollout.sidecar.openai_front.chat_prompt import chat_prompt_ids
from rollout.sidecar.openai_front.generation import Choice, choice_deltas, routed_experts_b64
from rollout.sidecar.openai_front.responses import envelope, usage
from rollout.sidecar.openai_front.schema import ChatCompletionRequest

_KIND, _CHUNK = "chat.completion", "chat.completion.chunk"


class Chat:
    """One request: its prompt, its params, and its choices written as OpenAI's."""

    def __init__(self, front, req: ChatCompletionRequest):
        manager = front.manager
        self.front, self.req = front, req
        chat_tools.check_tool_call_ids(req.messages)
        self.parser = front.tools.parser_for(req)  # None: the answer is text
        ids = chat_prompt_ids(req.messages, manager.tokenizer, req.tools, req.chat_template_kwargs,
                              req.add_generation_prompt, front.chat_template)
        self.ids = manager.prepare_prompt(ids)
        self.prompts = [self.ids]
        self.params = req.engine_params(len(self.ids), front.limits)
        front.check(self.params)

    def _logprobs(self, token_ids, logprobs, top) -> dict | None:
        fmt = self.front.fmt.with_ids() if self.req.return_tokens_as_token_ids else self.front.fmt
        return fmt.chat(token_ids, logprobs, top, self.params.logprobs) if self.req.logprobs else None

    def whole(self, rid: str, choices: list[Choice]) -> dict:
        body = []
        for c in choices:
            got = self.parser.extract(c.text.sent) if self.parser else None
            body.append({"index": c.index, "message": chat_tools.message(got, c.text.sent),
                         "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs),
                         "finish_reason": chat_tools.finish_reason(got, c.finish_reason), "token_ids": c.token_ids,
                         "weight_versions": c.weight_versions,
                         **({"routed_experts": routed_experts_b64(c)} if self.params.return_routed_experts else {})})
        return envelope(_KIND, rid, self.front.model, body, prompt_token_ids=self.ids,
                        usage=usage(len(self.ids), sum(len(c.token_ids) for c in choices)))

    async def chunks(self, rid: str) -> AsyncIterator[dict]:
        front, t0 = self.front, time.monotonic()
        first_token = True
        for i in range(self.params.n):  # each choice opens with its role, as OpenAI's stream does
            extra = {"prompt_token_ids": self.ids} if i == 0 else {}
            yield envelope(_CHUNK, rid, front.model, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None,
                                                       "token_ids": [], "weight_versions": []}], **extra)
        completion_tokens = 0
        streams = [self.parser.stream() for _ in range(self.params.n)] if self.parser else None
        async for c, d, text in choice_deltas(front.manager, [self.ids], self.params):
            if first_token and d.token_ids:
                front.metrics.first_token(time.monotonic() - t0)
                first_token = False
            completion_tokens += len(d.token_ids)
            delta, finish = self._delta(streams[c.index] if streams else None, text, d.finish_reason)
            yield envelope(_CHUNK, rid, front.model, [{
                "index": c.index, "delta": delta, "logprobs": self._logprobs(d.token_ids, d.logprobs, d.top_logprobs),
                "finish_reason": finish, "token_ids": d.token_ids, "weight_versions": d.weight_versions}])
        if self.req.include_usage:
            yield envelope(_CHUNK, rid, front.model, [], usage=usage(len(self.ids), completion_tokens))

    @staticmethod
    def _delta(stream, text: str, engine_finish: str | None) -> tuple[dict, str | None]:
        """One engine step's `delta` and `finish_reason`; through the choice's tool-call stream if any."""
        if stream is None:
            return ({"content": text} if text or not engine_finish else {}), engine_finish
        deltas = stream.feed(text) if text else []
        if engine_finish is None:
            return chat_tools.merged(deltas) or {"content": ""}, None
        deltas += stream.finish()
        return chat_tools.merged(deltas), chat_tools.finish_reason(stream.extracted, engine_finish)
