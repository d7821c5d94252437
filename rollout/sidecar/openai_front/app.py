"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, vLLM's /inference/v1/generate, /health,
/load, /metrics.

Every failure is an OpenAI-style error body (`{"error": {"message", "type", "param", "code"}}`):
400 a bad field (named) or a value the engine would refuse (checked before a stream's 200 goes
out), 401 a missing or wrong bearer token, 404 an unknown model, 413 a body over the limit, 503
while shutting down or when no engine can serve, 500 a bug. A request's failure is its own:
nothing a client sends reaches another one, and its connection stays open.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.inputs import validate_params
from rollout.sidecar.group_stream import ShuttingDown
from rollout.sidecar.load_report import load_report
from rollout.sidecar.openai_front.chat import Chat
from rollout.sidecar.openai_front.chat_tools import ToolOptions
from rollout.sidecar.openai_front.completions import Completions
from rollout.sidecar.openai_front.disconnect import until_disconnected
from rollout.sidecar.openai_front.generation import whole_choices
from rollout.sidecar.openai_front.limits import BodyLimit, Crashes, Gate
from rollout.sidecar.openai_front.metrics import FrontMetrics
from rollout.sidecar.openai_front.responses import LogprobFormat, error_body, new_id
from rollout.sidecar.openai_front.schema import ChatCompletionRequest, CompletionRequest, Limits
from rollout.sidecar.openai_front.vllm_generate import VllmGenerate
from rollout.sidecar.supervision import NoEngineError

_encode = msgspec.json.Encoder().encode  # a chunk per token per stream: the fast encoder

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "service_unavailable"}


class FrontState:
    """What the sidecar tells the app: whether it still takes requests."""

    accepting = True


class _Front:
    """What the routes share: the manager, the served model's name, the logprob format, the counters,
    and the chat options (tool-call flags, a --chat-template in place of the tokenizer's)."""

    def __init__(self, manager, model: str, metrics: FrontMetrics, tools: ToolOptions | None = None,
                 chat_template: str | None = None):
        self.manager, self.model, self.metrics = manager, model, metrics
        self.tools, self.chat_template = tools or ToolOptions(), chat_template
        self.fmt = LogprobFormat(manager.tokenizer)
        self.limits = Limits(manager.max_model_len, manager.vocab_size, manager.engines[0].cfg.max_logprobs)

    def check(self, params) -> None:
        """Refuses now (ValueError, a 400) anything else the engines would refuse when the request
        reaches them, by their own rule: a stream's 200 goes out before that."""
        validate_params(params, self.limits.vocab_size, self.limits.max_logprobs)


def build_app(manager, model_name: str, token: str = "", max_body_bytes: int = 8 << 20,
              state: FrontState | None = None, rl_transfer=None, tools: ToolOptions | None = None,
              chat_template: str | None = None, sglang_transfer=None) -> FastAPI:
    state = state or FrontState()
    front = _Front(manager, model_name, FrontMetrics(manager), tools, chat_template)
    app = FastAPI(title="rollout sidecar", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Crashes)  # innermost: a bug's 500 is answered here, not by closing the connection
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(Gate, state=state, token=token, metrics=front.metrics)  # outermost: before a body is read
    _answer_errors_as_openai(app)
    _add_info_routes(app, front)
    _add_generation_routes(app, front)
    if rl_transfer is not None:  # vLLM's RL routes (rollout/sidecar/openai_front/rl_routes.py)
        from rollout.sidecar.openai_front.rl_routes import add_rl_routes

        add_rl_routes(app, rl_transfer)
    if sglang_transfer is not None:  # SGLang's RL routes and /generate (rollout/sidecar/openai_front/sglang_routes.py)
        from rollout.sidecar.openai_front.sglang_routes import add_sglang_routes

        add_sglang_routes(app, sglang_transfer, front, relabel=rl_transfer is None)
    return app


def _add_info_routes(app: FastAPI, front: _Front) -> None:
    manager = front.manager
    started = int(time.time() - manager.state.uptime_s)

    @app.get("/health")
    async def health():
        h = await manager.health(timeout=5.0)
        return JSONResponse(msgspec.to_builtins(h), status_code=200 if h.engines > 0 else 503)

    @app.get("/load")
    async def load():
        """How busy this sidecar is (protocol.LoadReply), for routers: no forward runs to answer it."""
        return JSONResponse(msgspec.to_builtins(await load_report(manager)))

    @app.get("/metrics")
    async def prometheus():
        await front.metrics.refresh()
        body, content_type = front.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": front.model, "object": "model", "created": started,
                                            "owned_by": "rollout-sidecar", "max_model_len": manager.max_model_len}]}


def _add_generation_routes(app: FastAPI, front: _Front) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await _generate(request, front, Completions, req, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        return await _generate(request, front, Chat, req, "chatcmpl")

    @app.post("/inference/v1/generate")
    async def vllm_generate(request: Request):
        """vLLM's token-in token-out route (rollout/sidecar/openai_front/vllm_generate.py)."""
        try:
            job = VllmGenerate(front, msgspec.json.decode(await request.body()))
        except msgspec.DecodeError as e:
            raise HTTPException(400, detail={"message": f"the body is not JSON: {e}", "param": None}) from e
        except ValueError as e:
            raise HTTPException(400, detail={"message": str(e), "param": getattr(e, "param", None)}) from e
        if job.body.get("stream"):
            return _sse(job.chunks())
        return job.whole(await until_disconnected(request, whole_choices(front.manager, job.prompts, job.params)))


async def _generate(request: Request, front: _Front, endpoint, req, id_prefix: str):
    """One generation request: `endpoint` (Completions or Chat) checks it and writes its answer."""
    if req.model != front.model:
        raise HTTPException(404, detail={"message": f"model {req.model!r} does not exist; this sidecar serves "
                                                    f"{front.model!r}", "param": "model"})
    try:
        job = endpoint(front, req)
    except ValueError as e:
        raise HTTPException(400, detail={"message": str(e), "param": getattr(e, "param", None)}) from e
    rid = new_id(id_prefix)
    if req.stream:
        return _sse(job.chunks(rid))
    return job.whole(rid, await until_disconnected(request, whole_choices(front.manager, job.prompts, job.params)))


def _answer_errors_as_openai(app: FastAPI) -> None:
    """Every error as OpenAI's body: ours (HTTPException) and pydantic's (a 400 naming each field,
    where FastAPI would say 422). A bug's 500 is limits.Crashes'."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        d = e.detail if isinstance(e.detail, dict) else {"message": str(e.detail)}
        return JSONResponse(error_body(e.status_code, d["message"], _KINDS.get(e.status_code, "error"), d.get("param")),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError):
        problems = [f"{'.'.join(str(p) for p in err['loc'][1:]) or 'body'}: {err['msg']}" for err in e.errors()]
        first = e.errors()[0]["loc"] if e.errors() else ()
        return JSONResponse(error_body(400, "; ".join(problems), "invalid_request_error",
                                       ".".join(str(p) for p in first[1:]) or None), status_code=400)


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def lines():
        try:
            async for chunk in chunks:
                yield b"data: " + _encode(chunk) + b"\n\n"
        except (NoEngineError, ShuttingDown) as e:  # the status is out already: an error event, as OpenAI's
            yield b"data: " + _encode(error_body(503, str(e), "service_unavailable")) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
