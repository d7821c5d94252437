"""Where an episode's assistant turns come from: the sidecar through `AsyncRolloutClient` (no HTTP)
or through its OpenAI-compatible front with the official `openai` client (what any agent framework
would use in its place). Both send the conversation with every earlier assistant turn carrying its
sampled `token_ids` (rollout/sidecar/openai_front/chat_prompt.py: spliced in as sampled, never re-tokenised),
and both answer a `Turn`: the prompt's ids, the turn's ids, the engine's logprob and weight version
of each token, and the turn as an OpenAI message dict.

A request the sidecar refuses or fails (a prompt over its max_model_len, a `tool_call_id` naming no
call, a template that refuses the messages: any HTTP error status, or the sidecar's refusal on ZMQ)
raises `TurnError`: the episode runner ends that episode and the run goes on. A sidecar that is gone
(its connection lost) is not one episode's fault: that error stays as it is.

`TurnThread` runs one of them on its own event loop thread, so a trainer's blocking loop can push
weights while episodes are in flight."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass

from engine import SamplingParams

log = logging.getLogger("recipes")


class TurnError(RuntimeError):
    """The sidecar refused or failed one turn's request. `status`: the HTTP status (openai
    transport), or the sidecar's error kind (rollout.common.protocol.ERROR_KINDS; client transport)."""

    def __init__(self, message: str, status: int | str):
        super().__init__(message)
        self.status = status


@dataclass
class Turn:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str
    message: dict  # {"role": "assistant", "content", optional "tool_calls"}: what the environment reads


def history_message(turn: Turn) -> dict:
    """The turn as sent back in the next request: its message with its `token_ids` (a template
    that cannot render a None content gets ""). A turn that called tools keeps its `tool_calls` (a
    tool message's `tool_call_id` names one); the prompt renders it as its sampled ids all the same
    (rollout/sidecar/openai_front/chat_prompt.py), never the calls a second time."""
    return {**turn.message, "content": turn.message.get("content") or "", "token_ids": turn.token_ids}


def takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a request's `tools` (the front's own test: it names them)."""
    return "tools" in (chat_template or "")


def parsed_message(text: str, parser) -> dict:
    """The assistant message of `text`: with `parser` (`rollout.tool_calls.get_tool_parser(name)`), the
    tool calls read out of it, in the shape the OpenAI front answers (content None when the calls are
    all there is); without, the text alone."""
    if parser is None:
        return {"role": "assistant", "content": text}
    found = parser.extract(text)
    message = {"role": "assistant", "content": found.content}
    if found.tools_called:
        message["tool_calls"] = [c.as_openai() for c in found.tool_calls]
    return message


class ClientTurns:
    """Turns through `AsyncRolloutClient`: the prompt built here with the HTTP front's own function
    (rollout.sidecar.openai_front.chat_prompt), so both paths give the same ids for the same conversation;
    `chat_template`: the one the front was given (`rollout.serve --chat-template`), else the
    tokenizer's; `parser`: reads the tool calls out of each turn's text, as the front's does."""

    def __init__(self, client, tokenizer, parser=None, chat_template: str | None = None):
        self.client, self.tokenizer, self.parser, self.chat_template = client, tokenizer, parser, chat_template
        self.takes_tools = takes_tools(chat_template or getattr(tokenizer, "chat_template", None))

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        from rollout.sidecar.openai_front.chat_prompt import chat_prompt_ids
        from rollout.sidecar.openai_front.schema import ChatMessage

        return chat_prompt_ids([ChatMessage.model_validate(m) for m in messages], self.tokenizer,
                               tools if self.takes_tools else None, chat_template=self.chat_template)

    async def __call__(self, messages: list[dict], tools, max_tokens: int, temperature: float, seed: int | None,
                       session: str | None = None) -> Turn:
        from rollout.sidecar.openai_front.chat_prompt import ChatPromptError
        from rollout.client.sidecar_link import SidecarError

        try:
            ids = self.prompt_ids(messages, tools)
        except ChatPromptError as e:  # what the front answers 400
            raise TurnError(str(e), "invalid") from e
        params = SamplingParams(n=1, temperature=temperature, max_tokens=max_tokens, seed=seed)
        try:
            (r,), = await self.client.generate([ids], params, sessions=session)
        except SidecarError as e:
            if e.kind == "gone":
                raise
            raise TurnError(str(e), e.kind) from e
        return Turn(r.prompt_token_ids, r.token_ids, r.logprobs, r.weight_versions, r.finish_reason,
                    parsed_message(r.text, self.parser))

    def end_session(self, session: str) -> None:
        """The episode is over: its sidecar is no longer kept for it (rollout/client/placement.py)."""
        self.client.end_session(session)

    async def close(self) -> None:
        await self.client.close()


class OpenAITurns:
    """Turns through the sidecar's OpenAI front (`rollout.serve --http-port`) with `openai.AsyncOpenAI`;
    tool calls as the front parsed them (`--tool-call-parser`)."""

    def __init__(self, client, model: str, router=None):
        """`router`: an httpx.AsyncClient on a router's root (rollout.router), which keeps each episode's turns
        on one sidecar; None for one sidecar's front."""
        self.client, self.model, self.router = client, model, router
        self._finishing: set = set()

    async def __call__(self, messages: list[dict], tools, max_tokens: int, temperature: float, seed: int | None,
                       session: str | None = None) -> Turn:
        import openai

        extra = {"tools": tools} if tools else {}
        if self.router is not None and session is not None:  # a router keeps the session on one sidecar (rollout.router)
            extra["extra_headers"] = {"X-Session-ID": session}
        try:
            r = await self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=max_tokens,
                                                          temperature=temperature, seed=seed, logprobs=True, **extra)
        except openai.APIStatusError as e:  # a connection lost or timed out is no status: it stays as it is
            raise TurnError(f"HTTP {e.status_code}: {e.message}", e.status_code) from e
        c = r.choices[0]
        message = {"role": "assistant", "content": c.message.content}
        if c.message.tool_calls:
            message["tool_calls"] = [t.model_dump(exclude_none=True) for t in c.message.tool_calls]
        return Turn(r.prompt_token_ids, c.token_ids, [t.logprob for t in c.logprobs.content], c.weight_versions,
                    c.finish_reason, message)

    def end_session(self, session: str) -> None:
        """The episode is over: the router drops its pin (its /finish_session, in the background)."""
        if self.router is not None:
            task = asyncio.ensure_future(self._finish(session))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)

    async def _finish(self, session: str) -> None:
        try:
            (await self.router.post("/finish_session", params={"session_id": session})).raise_for_status()
        except Exception as e:  # noqa: BLE001 - a pin left behind idles out (the router's --idle-s)
            log.debug("finish_session %s: %s", session, e)

    async def close(self) -> None:
        await asyncio.gather(*self._finishing, return_exceptions=True)
        if self.router is not None:
            await self.router.aclose()
        await self.client.close()


class TurnThread:
    """An event loop on a thread of its own, holding a turn source built on it by `make()` (an async
    function); `submit(coro_fn, *args)` runs `coro_fn(turns, *args)` there and returns a
    concurrent.futures.Future."""

    def __init__(self, make):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="episodes", daemon=True)
        self.thread.start()
        self.turns = self._wait(make())

    def _wait(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, coro_fn, *args) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro_fn(self.turns, *args), self.loop)

    def close(self) -> None:
        try:
            self._wait(self.turns.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


def client_turns(url: str | list[str], token: str, tokenizer, parser=None,
                 chat_template: str | None = None) -> TurnThread:
    from rollout import AsyncRolloutClient

    async def make():
        return ClientTurns(AsyncRolloutClient(url, token=token), tokenizer, parser, chat_template)

    return TurnThread(make)


def openai_turns(base_url: str, token: str, timeout_s: float = 600.0, routed: bool = False) -> TurnThread:
    """`base_url`: the front's root (LocalSidecar.http_url, or a router's: `routed`, and each episode's
    turns name its session); the served model's name is asked once."""
    import httpx
    import openai

    async def make():
        client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=token or "none",
                                    max_retries=0, timeout=timeout_s)
        model = (await client.models.list()).data[0].id
        router = None
        if routed:
            router = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=30,
                                       headers={"Authorization": f"Bearer {token}"} if token else {})
        return OpenAITurns(client, model, router)

    return TurnThread(make)
