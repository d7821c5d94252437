"""The sidecars a router serves over, as it sees them by asking each one's GET /load every `poll_s`
(rollout/sidecar/load_report.py: no forward runs to answer it).

A sidecar is `serving` (it takes calls), `behind` (it answers, but holds older weights than the newest
the others serve: it came back, or started late, and waits to be caught up by its trainer's client:
rollout/client/catch_up.py), `gone` (it did not answer: its sessions move), `starting` (not heard yet:
one added by `add` starts so, and serves once it holds the newest version) or `removed` (by `remove`; it
keeps its index, as the placement counts by index).
A sidecar that serves stays serving while a push moves the others ahead of it for a moment; one that
comes back (after `gone`, or with a version lower than it served, a restarted process) serves again only
once it holds the newest version. One whose push has lasted more than `paused_s` takes no calls until it
ends (its sessions move).

Peers that die, hang or lie: a refused or reset connection, or a reply that is not a load report, makes a
sidecar `gone` at once; a poll that times out only once `misses` in a row have (a sidecar on loaded cores
can miss one answer: taking it for gone moved every new session elsewhere, and a hung one still goes
within `misses` polls; SGLang's router counts health failures the same way).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx
import msgspec

from rollout.common.protocol import LoadReply

log = logging.getLogger("rollout.router")

SERVING, BEHIND, GONE, STARTING, REMOVED = "serving", "behind", "gone", "starting", "removed"
_decode = msgspec.json.Decoder(LoadReply).decode


@dataclass
class Sidecar:
    url: str  # its HTTP front's base URL
    state: str = STARTING
    load: LoadReply | None = None
    reason: str = ""
    pushing_since: float | None = None
    misses: int = 0  # polls timed out in a row
    changes: list[str] = field(default_factory=list)  # its state changes, oldest first (for /health)


class Sidecars:
    def __init__(self, urls: list[str], http: httpx.AsyncClient, token: str = "", poll_s: float = 0.5,
                 paused_s: float = 60.0, clock=time.monotonic, on_load=None, poll_timeout_s: float = 5.0,
                 misses: int = 3):
        """`on_load(i, LoadReply, asked_at)`: called with each answer and what `on_load.snapshot()` gave when it
        was asked (the placement reads the sidecars' own load)."""
        if not urls:
            raise ValueError("no sidecar to route to")
        if misses < 1 or poll_timeout_s <= 0:
            raise ValueError(f"misses must be >= 1 and poll_timeout_s > 0, got {misses} and {poll_timeout_s}")
        self.all = [Sidecar(u.rstrip("/")) for u in urls]
        self.http, self.poll_s, self.paused_s, self.clock = http, poll_s, paused_s, clock
        self.poll_timeout_s, self.misses = poll_timeout_s, misses
        self.on_load = on_load
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.polled = asyncio.Event()  # set once every sidecar was heard or found gone (not merely slow)
        self.newest = 0  # the newest weight version a sidecar served under this router

    def serving(self) -> list[int]:
        """The sidecars that take calls now."""
        now = self.clock()
        return [i for i, s in enumerate(self.all) if s.state == SERVING
                and (s.pushing_since is None or now - s.pushing_since <= self.paused_s)]

    async def watch(self) -> None:
        while True:
            await self.poll()
            if all(s.state != STARTING for s in self.all):
                self.polled.set()
            await asyncio.sleep(self.poll_s)

    def add(self, url: str) -> bool:
        """A sidecar to route to from now on (False: it is routed to already); it serves once a poll finds it
        holding the newest version."""
        url = url.rstrip("/")
        if any(s.url == url and s.state != REMOVED for s in self.all):
            return False
        self.all.append(Sidecar(url))
        log.info("sidecar %s added", url)
        return True

    def remove(self, url: str) -> bool:
        """No more calls to this sidecar (False: not routed to); its sessions move."""
        url = url.rstrip("/")
        for s in self.all:
            if s.url == url and s.state != REMOVED:
                self._set(s, REMOVED, "removed")
                return True
        return False

    async def poll(self) -> None:
        present = [i for i, s in enumerate(self.all) if s.state != REMOVED]
        asked_at = self.on_load.snapshot() if self.on_load is not None else None
        replies = await asyncio.gather(*(self._ask(self.all[i]) for i in present), return_exceptions=True)
        heard = [(i, r) for i, r in zip(present, replies) if isinstance(r, LoadReply)]
        for i, r in zip(present, replies):
            if isinstance(r, LoadReply):
                self.all[i].misses = 0
            else:
                self._missed(self.all[i], r)
        # the newest a serving sidecar holds now, or (none serving yet) the newest any holds; never back:
        # a sidecar restarted on older weights must not serve them because its peers are gone too
        serving = [r.version for i, r in heard if self.all[i].state == SERVING]
        self.newest = max(self.newest, *(serving or [r.version for _, r in heard] or [0]))
        for i, r in heard:
            self._heard(self.all[i], r, self.newest)
            if self.on_load is not None:
                self.on_load(i, r, asked_at)

    async def _ask(self, s: Sidecar) -> LoadReply:
        resp = await self.http.get(s.url + "/load", headers=self.headers, timeout=self.poll_timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"GET /load answered {resp.status_code}: {resp.text[:200]}")
        return _decode(resp.content)

    def _heard(self, s: Sidecar, r: LoadReply, newest: int) -> None:
        if s.state == REMOVED:  # removed while its poll was on the wire
            return
        restarted = s.load is not None and r.version < s.load.version
        s.load = r
        s.pushing_since = (s.pushing_since or self.clock()) if r.pushing else None
        if r.engines == 0:
            self._set(s, GONE, "no engine serves")
        elif s.state == SERVING and not restarted:
            pass
        elif r.version >= newest:
            self._set(s, SERVING, f"holds version {r.version}")
        else:
            self._set(s, BEHIND, f"holds version {r.version}, the others {newest}: waits to be caught up")

    def _missed(self, s: Sidecar, e: BaseException) -> None:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if isinstance(e, httpx.TimeoutException):
            s.misses += 1
            if s.misses < self.misses:
                log.info("sidecar %s: no load report in %.1f s (%d of %d misses before it counts as gone)",
                         s.url, self.poll_timeout_s, s.misses, self.misses)
                return
            why = f"{self.misses} polls in a row timed out ({why})"
        self.lost(s, why)

    def lost(self, s: Sidecar, why: str) -> None:
        """Sidecar s did not answer (a poll, or a call that could not reach it): no calls until it does."""
        if s.state not in (GONE, REMOVED):  # a removed one's calls still failing leave it removed
            self._set(s, GONE, why)
            s.load = None  # a process that comes back is a new one: caught up before it serves

    def _set(self, s: Sidecar, state: str, why: str) -> None:
        if s.state == state:
            return
        level = logging.WARNING if state in (GONE, BEHIND) else logging.INFO
        log.log(level, "sidecar %s: %s -> %s (%s)", s.url, s.state, state, why)
        s.state, s.reason = state, why
        s.changes = (s.changes + [f"{state}: {why}"])[-8:]
