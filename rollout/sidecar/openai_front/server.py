"""The HTTP front inside the sidecar's process and event loop (uvicorn, embedded): one manager,
one set of engines and one pause state for ZMQ and HTTP alike. The sidecar owns the signals:
on SIGTERM it stops taking HTTP requests (503), ends the ones in flight with the engines, then
closes the server."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from rollout.sidecar.group_stream import end_streams
from rollout.sidecar.openai_front.app import FrontState, build_app

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # SIGTERM and SIGINT are the sidecar's (rollout/sidecar/main.py)
        yield


class HttpFront:
    def __init__(self, manager, host: str, port: int, model_name: str, token: str = "",
                 max_body_bytes: int = 8 << 20, rl_transfer=None, tools=None, chat_template: str | None = None,
                 sglang_transfer=None):
        self.state = FrontState()
        self.manager, self.host = manager, host
        app = build_app(manager, model_name, token=token, max_body_bytes=max_body_bytes, state=self.state,
                        rl_transfer=rl_transfer, tools=tools, chat_template=chat_template,
                        sglang_transfer=sglang_transfer)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=3, timeout_keep_alive=30)
        self.server = _EmbeddedServer(config)
        self.task: asyncio.Task | None = None
        self.url = ""

    async def start(self) -> str:
        """Binds and serves; returns the base URL (`http://host:port`, the port resolved)."""
        self.task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if self.task.done():  # uvicorn exits (SystemExit) when it cannot bind
                raise RuntimeError(f"the HTTP front could not start on {self.host}: {self.task.exception()!r}")
            await asyncio.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        log.info("OpenAI-compatible HTTP front on %s/v1", self.url)
        return self.url

    def stop_accepting(self) -> None:
        """New requests get 503; requests in flight end now (a stream with an error event)."""
        self.state.accepting = False
        end_streams(self.manager, "the sidecar is shutting down")

    async def close(self) -> None:
        if self.task is None:
            return
        self.state.accepting = False
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 5)
        except (asyncio.TimeoutError, BaseException) as e:  # noqa: BLE001 - shutting down regardless
            if not isinstance(e, asyncio.TimeoutError):
                log.debug("HTTP front stopped with %r", e)
            self.server.force_exit = True
