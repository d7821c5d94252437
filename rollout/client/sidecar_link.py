"""One sidecar as the client sees it: its socket, its place in the rotation, and the watch that
notices it go.

A sidecar is `active` (serves generate, is in the weight-sync group), `catching up` (added mid-run
after a push: a live sidecar is sending it the newest weights; no prompts, no trainer pushes),
`joining` (it holds older weights and could not be caught up: no prompts until a push reaches it) or `dropped`
(its connection closed, or its ZMQ heartbeats went unanswered; never used again, since its calls
died with it). A sidecar that comes back behind the same address (a restarted process, a host back on
its link) is noticed by a probe (`wait_for_return`) and taken back as a new link, caught up first.

A killed sidecar is noticed at once: its host's kernel closes the TCP connection. A host that
vanishes without closing it is noticed by heartbeats: libzmq's I/O thread answers them without
the GIL, so a busy sidecar (a long push, a forward) is never taken for a dead one; a stopped or
frozen one is.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

ACTIVE, CATCHING_UP, JOINING, DROPPED = "active", "catching up", "joining", "dropped"
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 10000  # a peer silent this long (process stopped, host gone) is dropped


class SidecarError(RuntimeError):
    """A sidecar refused or failed a call; the message is the sidecar's reason, `kind` how it
    failed, as the sidecar said it (protocol.ERROR_KINDS; "" when not the sidecar's word;
    "gone" when the sidecar's connection was lost)."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind

    @property
    def error_kind(self) -> str:  # read by engine.errors.error_kind, as every error's kind is
        return self.kind or "failed"


class SidecarGoneError(SidecarError):
    """The sidecar's connection closed (or went silent) while a call waited on it."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"sidecar {url} is gone: {reason}", "gone")
        self.url = url


class SidecarLink:
    def __init__(self, ctx: zmq.asyncio.Context, url: str, state: str):
        self.url, self.state, self.reason = url, state, ""
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.tasks: list[asyncio.Task] = []  # its reader and its watch, once a call started them

    @property
    def sockets(self) -> list:
        return [self.sock, self.monitor]

    def disconnect(self) -> None:
        """No reconnecting once dropped: messages still queued for the sidecar that went must not
        reach a new process behind the same address."""
        try:
            self.sock.disconnect(self.url)
        except zmq.ZMQError:  # never connected, or closed already
            pass

    async def watch(self, on_gone) -> None:
        """Calls `on_gone(reason)` when a connection that was up closes. A sidecar that never
        answered is left to the calls' timeouts (it may still be starting)."""
        connected = False
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connected = True
            elif event == zmq.EVENT_DISCONNECTED and connected:
                on_gone("its connection closed (the process died, or it missed "
                        f"{HEARTBEAT_TIMEOUT_MS / 1000:.0f} s of heartbeats)")
                return


async def wait_for_return(ctx: zmq.asyncio.Context, url: str) -> None:
    """Returns once a sidecar answers at `url` again (a ZMTP handshake: a live process, not only a
    port). The probe never sends a message, so nothing meant for the sidecar that went reaches
    the one that came."""
    probe = ctx.socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    monitor = probe.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        probe.connect(url)
        await monitor.recv_multipart()
    finally:
        probe.disable_monitor()
        monitor.close(0)
        probe.close(0)
