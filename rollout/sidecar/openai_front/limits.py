"""What every request passes before an endpoint sees it, as pure ASGI middleware (Starlette's
BaseHTTPMiddleware would pipe each streamed chunk through an extra memory stream):
- Gate: 503 while the sidecar shuts down, 401 without the bearer token (when one is set; /health
  and /load are open to load balancers and routers), and the count of answers by path and status for /metrics;
- BodyLimit: a body over the limit is answered 413 before it is parsed (by its Content-Length
  when it gives one, else as its bytes arrive), so no client makes the server hold more;
- Crashes: a bug in one request is a 500 for that request alone, and the connection stays open."""

from __future__ import annotations

import json
import logging
import secrets

from rollout.sidecar.openai_front.responses import error_body

log = logging.getLogger(__name__)


def _send_error(status: int, message: str, kind: str):
    body = json.dumps(error_body(status, message, kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def reply(send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return reply


class Gate:
    def __init__(self, app, state, token: str, metrics):
        self.app, self.state, self.metrics = app, state, metrics
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if not self.state.accepting:
            return await _send_error(503, "the sidecar is shutting down", "service_unavailable")(send)
        if self.expected is not None and path not in ("/health", "/load"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                self.metrics.request_done(path, 401)
                return await _send_error(401, "missing or wrong bearer token", "authentication_error")(send)

        async def counted(msg):
            if msg["type"] == "http.response.start":
                self.metrics.request_done(path, msg["status"])
            await send(msg)

        await self.app(scope, receive, counted)


class BodyLimit:
    """Pure ASGI middleware: buffers an HTTP body up to `max_bytes`, then hands it on whole."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not msg.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then what the client does next (a disconnect)

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        await _send_error(413, f"request body over {self.max_bytes} bytes", "invalid_request_error")(send)


class Crashes:
    """Innermost: an exception no handler took is answered 500 here. Starlette's outermost error
    middleware would answer it too, then re-raise it to uvicorn, which closes the connection: a
    client's next request on its kept-alive connection would fail for nothing it did."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if started:  # mid-response: nothing left to answer with
                raise
            log.exception("%s failed", scope["path"])
            await _send_error(500, f"internal error: {type(e).__name__}: {e}", "internal_error")(send)
