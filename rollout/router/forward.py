"""One generation call through the router: its session's sidecar (rollout/client/placement.py), the call
sent there as it came, and the answer relayed back as it comes.

A call fails over to another serving sidecar only while nothing of its answer has reached the caller:
the sidecar refused the connection, dropped it before its first byte, or answered 503 (shutting down, no
engine). A stream is relayed only once its first chunk is in, so a sidecar that dies before that costs a
retry elsewhere, never a duplicate; one that dies after it ends the stream with an error event (the
tokens so far were seen: sending the call again would sample them twice). Any other answer (a 400, a
401 from a sidecar that wants a token) is the caller's, as the sidecar gave it.
"""

from __future__ import annotations

import logging

import httpx
import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout.client.placement import Placement
from rollout.common.caller_gone import CallerGone, unless_caller_goes
from rollout.router.metrics import RouterMetrics
from rollout.router.session_key import session_key
from rollout.router.sidecars import Sidecars

log = logging.getLogger("rollout.router")

_PASSED = ("authorization", "content-type", "accept", "x-request-id", "x-session-id")  # headers sent on


class Forwarder:
    def __init__(self, sidecars: Sidecars, placement: Placement, http: httpx.AsyncClient, metrics: RouterMetrics,
                 max_body_bytes: int = 8 << 20):
        self.sidecars, self.placement, self.http, self.metrics = sidecars, placement, http, metrics
        self.max_body_bytes = max_body_bytes

    async def call(self, request: Request, path: str) -> Response:
        body = await self._body(request)
        if body is None:
            return error(413, f"the request body is over {self.max_body_bytes} bytes (--max-body-mb)",
                         "invalid_request_error")
        try:
            parsed = msgspec.json.decode(body) if body else None
        except msgspec.DecodeError:
            parsed = None  # the sidecar answers a bad body with its own 400
        try:
            key = session_key(request.headers, parsed)
        except ValueError as e:
            return error(400, str(e), "invalid_request_error")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED}
        tried: set[int] = set()
        why = []
        while True:
            serving = [i for i in self.sidecars.serving() if i not in tried]
            if not serving:
                self.metrics.unavailable.inc()
                reasons = "; ".join(why + [f"{s.url}: {s.state} ({s.reason})" for j, s in enumerate(self.sidecars.all)
                                           if j not in tried and s.state != "serving"])
                return error(503, f"no sidecar can take the call: {reasons or 'none configured'}",
                             "service_unavailable")
            i = self.placement.place([key], serving)[0] if key is not None else self.placement.pick(serving)
            tried.add(i)
            answer = await self._try(request, i, path, body, headers)
            if isinstance(answer, Response):
                return answer
            why.append(f"{self.sidecars.all[i].url}: {answer}")
            self.metrics.failovers.inc()
            log.warning("call to %s failed before any byte reached its caller (%s): trying another sidecar",
                        self.sidecars.all[i].url, answer)

    async def _body(self, request: Request) -> bytes | None:
        """The body, read up to the limit (None past it): a call is relayed whole, so no caller makes the router
        hold more (its Content-Length is believed only to refuse early)."""
        if int(request.headers.get("content-length") or 0) > self.max_body_bytes:
            return None
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                return None
            parts.append(part)
        return b"".join(parts)

    async def _try(self, request: Request, i: int, path: str, body: bytes, headers: dict) -> Response | str:
        """The call on sidecar i: its answer, or why it can go elsewhere (nothing was relayed)."""
        sidecar = self.sidecars.all[i]
        handed_on = False
        try:
            req = self.http.build_request(request.method, sidecar.url + path, content=body, headers=headers,
                                          params=request.query_params)
            resp = await self.http.send(req, stream=True)
            try:
                if resp.status_code == 503:
                    return f"503 {(await resp.aread())[:200].decode(errors='replace')}"
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    chunks = resp.aiter_raw()
                    first = await anext(chunks, b"")
                    if not first:
                        return "its stream closed before its first chunk"
                    handed_on = True
                    release = _Once(resp.aclose, lambda: self.placement.done(i))
                    return _Relay(self._relay(i, resp, first, chunks, release), release, status_code=resp.status_code,
                                  media_type="text/event-stream", headers=self._answer_headers(i))
                try:
                    content = await unless_caller_goes(request, resp.aread())
                except CallerGone:
                    self.metrics.answered(sidecar.url, 499)
                    return Response(status_code=499)
                self.metrics.answered(sidecar.url, resp.status_code)
                return Response(content, status_code=resp.status_code, headers=self._answer_headers(i),
                                media_type=resp.headers.get("content-type"))
            finally:
                if not handed_on:
                    await resp.aclose()
        except httpx.TransportError as e:  # refused, reset, or timed out before an answer reached the caller
            self.sidecars.lost(sidecar, f"{type(e).__name__}: {e}")
            return f"{type(e).__name__}: {e}"
        finally:
            if not handed_on:
                self.placement.done(i)

    async def _relay(self, i: int, resp: httpx.Response, first: bytes, chunks, release):
        url = self.sidecars.all[i].url
        try:
            yield first
            async for chunk in chunks:
                yield chunk
            self.metrics.answered(url, resp.status_code)
        except httpx.TransportError as e:  # its tokens so far reached the caller: never sent again
            self.sidecars.lost(self.sidecars.all[i], f"{type(e).__name__}: {e}")
            self.metrics.answered(url, 502)
            log.warning("sidecar %s went mid-stream (%s): the stream ends with an error", url, e)
            event = {"error": {"message": f"sidecar {url} went mid-stream ({type(e).__name__}); the call is not "
                                          "sent again (its first tokens were streamed)", "type": "server_error",
                               "code": 502}}
            yield b"data: " + msgspec.json.encode(event) + b"\n\ndata: [DONE]\n\n"
        finally:
            await release()  # a caller that went: the sidecar sees its connection close and aborts

    def _answer_headers(self, i: int) -> dict:
        return {"x-routed-to": self.sidecars.all[i].url}


class _Once:
    """The relayed stream's end, run once: its connection to the sidecar closed, its call no longer busy."""

    def __init__(self, close, done):
        self.close, self.done, self.ran = close, done, False

    async def __call__(self) -> None:
        if not self.ran:
            self.ran = True
            try:
                await self.close()
            finally:
                self.done()


class _Relay(StreamingResponse):
    """A relayed stream that ends its call even when it is never iterated (a caller gone before its first
    byte went out: the body's own `finally` would then never run)."""

    def __init__(self, chunks, release: _Once, **kw):
        super().__init__(chunks, **kw)
        self.release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()


def error(status: int, message: str, kind: str) -> JSONResponse:
    """OpenAI's error body, as the sidecars answer theirs."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)
