"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Every failure is an OpenAI-style error body (`{"error": {"message", "type", "param", "code"}}`):
400 a bad field (pydantic names it) or a value the engine refuses, 401 a missing or wrong bearer
token, 404 an unknown model, 413 a body over the limit, 503 while shutting down or when no
engine can serve. A request's failure is its own: nothing a client sends reaches another one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout.openai_front.chat_prompt import chat_prompt_ids
from rollout.openai_front.generation import choice_deltas, whole_choices
from rollout.openai_front.limits import BodyLimit, Gate
from rollout.openai_front.metrics import FrontMetrics
from rollout.openai_front.responses import LogprobFormat, envelope, error_body, new_id, usage
from rollout.openai_front.schema import ChatCompletionRequest, CompletionRequest
from rollout.group_stream import ShuttingDown
from rollout.supervision import NoEngineError

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode  # a chunk per token per stream: the fast encoder

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "service_unavailable"}


class FrontState:
    """What the sidecar tells the app: whether it still takes requests."""

    accepting = True


def build_app(manager, model_name: str, token: str = "", max_body_bytes: int = 8 << 20,
              state: FrontState | None = None) -> FastAPI:
    state = state or FrontState()
    metrics = FrontMetrics(manager)
    fmt = LogprobFormat(manager.tokenizer)
    started = int(time.time() - (time.monotonic() - manager.started))
    app = FastAPI(title="rollout sidecar", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(Gate, state=state, token=token, metrics=metrics)  # outermost: before a body is read

    def fail(status: int, message: str, param: str | None = None):
        raise HTTPException(status, detail={"message": message, "param": param})

    _answer_errors_as_openai(app)

    def check_model(name: str) -> None:
        if name != model_name:
            fail(404, f"model {name!r} does not exist; this sidecar serves {model_name!r}", "model")

    @app.get("/health")
    async def health():
        h = await manager.health(timeout=5.0)
        return JSONResponse(h, status_code=200 if h["engines"] > 0 else 503)

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "rollout-sidecar", "max_model_len": manager.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        try:
            params = req.sampling_params(req.max_tokens, req.logprobs)
            prompts = [manager.prepare_prompt(p) for p in req.prompts()]
        except ValueError as e:
            fail(400, str(e))
        rid = new_id("cmpl")
        if req.stream:
            return _sse(_completion_chunks(manager, fmt, metrics, rid, model_name, prompts, params, req))
        choices = await _until_disconnected(request, whole_choices(manager, prompts, params))
        body = [{"index": c.index, "text": c.text.sent, "finish_reason": c.finish_reason,
                 "logprobs": fmt.completion(c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs is not None
                 else None, "prompt_token_ids": c.prompt_ids, "token_ids": c.token_ids,
                 "weight_versions": c.weight_versions} for c in choices]
        n_prompt = sum(len(p) for p in prompts)
        return envelope("text_completion", rid, model_name, body,
                        usage=usage(n_prompt, sum(len(c.token_ids) for c in choices)))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        try:
            params = req.sampling_params(req.completion_budget(), req.logprobs_k())
            ids = chat_prompt_ids(req.messages, manager.tokenizer, req.tools, req.chat_template_kwargs,
                                  req.add_generation_prompt)
            ids = manager.prepare_prompt(ids)
        except ValueError as e:
            fail(400, str(e))
        rid = new_id("chatcmpl")
        if req.stream:
            return _sse(_chat_chunks(manager, fmt, metrics, rid, model_name, ids, params, req))
        choices = await _until_disconnected(request, whole_choices(manager, [ids], params))
        body = [{"index": c.index, "message": {"role": "assistant", "content": c.text.sent},
                 "logprobs": fmt.chat(c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs else None,
                 "finish_reason": c.finish_reason, "token_ids": c.token_ids,
                 "weight_versions": c.weight_versions} for c in choices]
        return envelope("chat.completion", rid, model_name, body, prompt_token_ids=ids,
                        usage=usage(len(ids), sum(len(c.token_ids) for c in choices)))

    return app


def _answer_errors_as_openai(app: FastAPI) -> None:
    """Every error as OpenAI's body: ours (HTTPException), pydantic's (a 400 naming each field,
    where FastAPI would say 422), and a bug's (500: this request fails, the server serves on)."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        d = e.detail if isinstance(e.detail, dict) else {"message": str(e.detail)}
        return JSONResponse(error_body(e.status_code, d["message"], _KINDS.get(e.status_code, "error"), d.get("param")),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception):
        log.exception("%s failed", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}", "internal_error"), 500)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError):
        problems = [f"{'.'.join(str(p) for p in err['loc'][1:]) or 'body'}: {err['msg']}" for err in e.errors()]
        first = e.errors()[0]["loc"] if e.errors() else ()
        return JSONResponse(error_body(400, "; ".join(problems), "invalid_request_error",
                                       ".".join(str(p) for p in first[1:]) or None), status_code=400)


async def _until_disconnected(request: Request, work):
    """Awaits `work`; a client that goes away meanwhile cancels it (its engine requests abort),
    as vLLM does. No engine at all is a 503."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client of %s went away: its request is aborted", request.url.path)
                task.cancel()
                raise HTTPException(499, detail={"message": "client disconnected"})
    except (NoEngineError, ShuttingDown) as e:
        raise HTTPException(503, detail={"message": str(e)})
    finally:
        if not task.done():
            task.cancel()


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def lines():
        try:
            async for chunk in chunks:
                yield b"data: " + _encode(chunk) + b"\n\n"
        except (NoEngineError, ShuttingDown) as e:  # the status is out already: an error event, as OpenAI's
            yield b"data: " + _encode(error_body(503, str(e), "service_unavailable")) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_chunks(manager, fmt, metrics, rid, model, ids, params, req) -> AsyncIterator[dict]:
    t0 = time.monotonic()
    first_token = True
    for i in range(params.n):  # each choice opens with its role, as OpenAI's stream does
        extra = {"prompt_token_ids": ids} if i == 0 else {}
        yield envelope("chat.completion.chunk", rid, model, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                              "logprobs": None, "finish_reason": None,
                                                              "token_ids": [], "weight_versions": []}], **extra)
    completion_tokens = 0
    async for c, d, text in choice_deltas(manager, [ids], params):
        if first_token and d.token_ids:
            metrics.first_token(time.monotonic() - t0)
            first_token = False
        completion_tokens += len(d.token_ids)
        yield envelope("chat.completion.chunk", rid, model, [{
            "index": c.index, "delta": {"content": text} if text or not d.finish_reason else {},
            "logprobs": fmt.chat(d.token_ids, d.logprobs, d.top_logprobs) if req.logprobs else None,
            "finish_reason": d.finish_reason, "token_ids": d.token_ids, "weight_versions": d.weight_versions}])
    if req.include_usage:
        yield envelope("chat.completion.chunk", rid, model, [], usage=usage(len(ids), completion_tokens))


async def _completion_chunks(manager, fmt, metrics, rid, model, prompts, params, req) -> AsyncIterator[dict]:
    t0 = time.monotonic()
    first_token = True
    completion_tokens = 0
    offsets: dict[int, int] = {}
    async for c, d, text in choice_deltas(manager, prompts, params):
        if first_token and d.token_ids:
            metrics.first_token(time.monotonic() - t0)
            first_token = False
        completion_tokens += len(d.token_ids)
        choice = {"index": c.index, "text": text, "finish_reason": d.finish_reason, "logprobs": None,
                  "token_ids": d.token_ids, "weight_versions": d.weight_versions}
        if req.logprobs is not None:
            choice["logprobs"] = fmt.completion(d.token_ids, d.logprobs, d.top_logprobs, offsets.get(c.index, 0))
        offsets[c.index] = len(c.text.sent)
        if len(c.token_ids) == len(d.token_ids):  # the choice's first chunk
            choice["prompt_token_ids"] = c.prompt_ids
        yield envelope("text_completion", rid, model, [choice])
    if req.include_usage:
        yield envelope("text_completion", rid, model, [], usage=usage(sum(map(len, prompts)), completion_tokens))
