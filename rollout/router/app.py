"""The router's FastAPI app: the generation routes of the sidecars' fronts, routed by session
(rollout/router/forward.py), and its own /health, /metrics, /finish_session, /add_worker, /remove_worker
and /v1/models.

Routed: OpenAI's /v1/completions and /v1/chat/completions (streaming and tool calls included: the
sidecar answers, the router relays), SGLang's /generate, and vLLM's /inference/v1/generate where the
sidecars serve it. A sidecar's weight routes (/update_weights, /pause, ...) are not routed: weights go
to every sidecar at once (a RolloutClient over their ZMQ ports, or each sidecar's own routes).

A token (`--token`): every route but /health wants `Authorization: Bearer <token>` (401 otherwise, as
the sidecars answer), and the header goes on to the sidecar, which checks it again.
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rollout.client.placement import Placement
from rollout.router.forward import Forwarder, error
from rollout.router.metrics import RouterMetrics, snapshot
from rollout.router.session_key import HEADER, session_key
from rollout.router.sidecars import Sidecars

ROUTED = ("/v1/completions", "/v1/chat/completions", "/generate", "/inference/v1/generate")


def build_app(urls: list[str], token: str = "", margin: int = 16, idle_s: float = 600.0, poll_s: float = 0.5,
              paused_s: float = 60.0, max_body_bytes: int = 8 << 20, poll_timeout_s: float = 5.0,
              misses: int = 3) -> FastAPI:
    http = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    placement = Placement(margin, idle_s)
    sidecars = Sidecars(urls, http, token, poll_s, paused_s, on_load=_LoadIntoPlacement(placement),
                        poll_timeout_s=poll_timeout_s, misses=misses)
    metrics = RouterMetrics()
    metrics.watch(sidecars, placement)
    forwarder = Forwarder(sidecars, placement, http, metrics, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app):
        watch = asyncio.ensure_future(sidecars.watch())
        await asyncio.wait({watch, asyncio.ensure_future(sidecars.polled.wait())}, return_when="FIRST_COMPLETED")
        try:
            yield
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await http.aclose()

    app = FastAPI(title="rollout router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    if token:
        app.add_middleware(_Gate, token=token)
    for path in ROUTED:
        app.add_api_route(path, _routed(forwarder, path), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        return await forwarder.call(request, "/v1/models")

    _add_session_and_worker_routes(app, sidecars, placement)
    _add_status_routes(app, sidecars, placement, metrics)
    return app


def _add_session_and_worker_routes(app: FastAPI, sidecars: Sidecars, placement: Placement) -> None:
    @app.post("/finish_session")
    async def finish_session(request: Request):
        """vllm-router's: the session is over, its pin dropped (`?session_id=`, the header, or the body's)."""
        key = request.query_params.get("session_id")
        if key is None:
            body = await request.json() if await request.body() else None
            try:
                key = session_key(request.headers, body)
            except ValueError as e:
                return error(400, str(e), "invalid_request_error")
        if key is None:
            return error(400, f"name the session: ?session_id=, the {HEADER} header or the body's session_id",
                         "invalid_request_error")
        placement.end(key)
        return {"session_id": key, "finished": True}

    @app.post("/add_worker")
    async def add_worker(url: str):
        """vllm-router's and SGLang's router's: route to one more sidecar's front (`?url=`); it gets calls once
        it holds the newest weights the others serve."""
        return {"url": url, "added": sidecars.add(url)}

    @app.post("/remove_worker")
    async def remove_worker(url: str):
        """No more calls to that sidecar (`?url=`); its sessions move to the others."""
        if not sidecars.remove(url):
            return error(404, f"no sidecar {url} is routed to", "not_found_error")
        return {"url": url, "removed": True}


def _add_status_routes(app: FastAPI, sidecars: Sidecars, placement: Placement, metrics: RouterMetrics) -> None:
    @app.get("/health")
    async def health():
        snap = snapshot(sidecars, placement)
        body = {"ok": snap["serving"] > 0, **snap}
        for s in sidecars.all:  # a sidecar removed and added again: its newest entry (as in the snapshot)
            body["sidecars"][s.url].update(reason=s.reason, changes=s.changes, misses=s.misses)
        return JSONResponse(body, status_code=200 if body["ok"] else 503)

    @app.get("/metrics")
    async def prometheus():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)


class _LoadIntoPlacement:
    """Each sidecar's /load reply into the placement, beside the router's own calls there when it asked."""

    def __init__(self, placement: Placement):
        self.placement = placement

    def snapshot(self) -> dict:
        return self.placement.asked()

    def __call__(self, i: int, load, asked_at: dict) -> None:
        self.placement.observe(i, load.groups, load.kv_used, asked_at.get(i, (0, 0)))


def _routed(forwarder: Forwarder, path: str):
    async def route(request: Request):
        return await forwarder.call(request, path)

    route.__name__ = "route_" + path.strip("/").replace("/", "_")
    return route


class _Gate:
    """401 without the bearer token, but on /health. Pure ASGI: Starlette's BaseHTTPMiddleware would pipe
    every relayed chunk through a memory stream of its own."""

    def __init__(self, app, token: str):
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                refusal = error(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                                "authentication_error")
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)
