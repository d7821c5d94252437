"""`SidecarSet`: the sidecars one client talks to, as links (rollout.client.sidecar_link), and the calls
over them: one message per call, its answers on a queue of their own, a sidecar that goes failing
every call waiting on it (SidecarGoneError). A sidecar keeps its index for good, dropped or not.

It is the links that `WeightSyncClient` pushes over (rollout.client.push_links.PushLinks) and the ones
that generation (rollout.client.spread) and an added sidecar's catch-up (rollout.client.catch_up) use.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from typing import Any

import zmq
import zmq.asyncio

from rollout.common import protocol as P
from rollout.client.sidecar_link import (
    ACTIVE, DROPPED, JOINING, SidecarError, SidecarGoneError, SidecarLink, wait_for_return,
)

log = logging.getLogger("rollout.client")


class SidecarSet:
    """The client's sidecars and its calls to them; as PushLinks (rollout/client/push_links.py, whose
    docstrings say what `members`, `url`, `state`, `call`, `ask_all`, `drop`, `pushed` and
    `gone_reasons` do) it is what WeightSyncClient pushes over."""

    def __init__(self, urls: list[str], token: str, timeout_s: float):
        self.token = token
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        # a client dropped without close() must not leave its context to Context.__del__, whose
        # term() blocks forever on sockets still open: close them (LINGER 0) when it goes
        self._socks: list = []  # every socket ever opened, for the finalizer (links added later too)
        self.release = weakref.finalize(self, _release_sockets, self._ctx, self._socks)
        self._links: list[SidecarLink] = []  # indexed for good: a dropped one keeps its place
        for url in urls:
            self.connect(url, ACTIVE)
        self._ids = itertools.count()
        self._queues: dict[tuple[int, int], asyncio.Queue] = {}
        self.on_return = None  # async (url) -> None: a sidecar that went answers at its address again
        self._returns: list[asyncio.Task] = []  # the probes waiting for that

    # -- the links ------------------------------------------------------------------------------
    def members(self, *states: str) -> list[int]:
        return [i for i, link in enumerate(self._links) if link.state in states]

    def url(self, i: int) -> str:
        return self._links[i].url

    def state(self, i: int) -> str:
        return self._links[i].state

    def in_use(self) -> list[int]:
        """Every sidecar not dropped, in the order they were given."""
        return [i for i, link in enumerate(self._links) if link.state != DROPPED]

    def connect(self, url: str, state: str) -> int:
        link = SidecarLink(self._ctx, url, state)
        self._socks.extend(link.sockets)
        self._links.append(link)
        return len(self._links) - 1

    def serve(self, i: int, version: int) -> None:
        """Sidecar i holds `version`, the newest: it takes prompts."""
        self._links[i].state = ACTIVE
        log.info("sidecar %s holds version %d and serves", self._links[i].url, version)

    def wait_for_push(self, i: int, why: str, level: int = logging.INFO) -> None:
        """Sidecar i holds older weights: no prompts until a push reaches it (it joins the next group)."""
        self._links[i].state = JOINING
        log.log(level, "sidecar %s %s: it serves after the next push", self._links[i].url, why)

    def pushed(self, members, version: int) -> list[int]:
        """`version` committed on `members`: joining ones serve; active ones that missed it wait (returned)."""
        joining = [i for i in members if self._links[i].state == JOINING]
        missed = [i for i in self.members(ACTIVE) if i not in members]
        for i in joining:
            self.serve(i, version)
        for i in missed:
            self.wait_for_push(i, f"missed version {version}")
        return missed

    def keep_task(self, i: int, task: asyncio.Task) -> None:
        """A task about sidecar i: cancelled when it is dropped or the set closes."""
        self._links[i].tasks.append(task)

    def start(self) -> None:
        for i, link in enumerate(self._links):
            if not link.tasks and link.state != DROPPED:
                link.tasks = [asyncio.ensure_future(self._read(i)),
                              asyncio.ensure_future(link.watch(lambda why, i=i: self.drop(i, why, True)))]

    def drop(self, i: int, reason: str, may_return: bool = False) -> None:
        """Sidecar i leaves for good: every call waiting on it fails with SidecarGoneError.
        `may_return`: it went by itself (its connection closed, or it shut down), so a sidecar that
        answers at its address later is taken back (`on_return`), as a new link."""
        link = self._links[i]
        if link.state == DROPPED:
            return
        log.warning("sidecar %s dropped: %s; its work goes to the others", link.url, reason)
        link.state, link.reason = DROPPED, reason
        link.disconnect()
        for (j, _), q in list(self._queues.items()):
            if j == i:
                q.put_nowait(SidecarGoneError(link.url, reason))
        for t in link.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        if may_return and self.on_return is not None:
            self._returns.append(asyncio.ensure_future(self._take_back_when_it_answers(link.url)))

    async def _take_back_when_it_answers(self, url: str) -> None:
        await wait_for_return(self._ctx, url)
        if any(self.url(j) == url for j in self.in_use()):  # added back by hand meanwhile
            return
        try:
            await self.on_return(url)
        except Exception as e:  # noqa: BLE001 - it stays out; add_sidecar can still bring it in
            log.warning("sidecar %s answers again but could not be taken back: %s", url, e)

    def gone_reasons(self) -> str:
        return "; ".join(f"{link.url}: {link.reason}" for link in self._links if link.state == DROPPED)

    async def close(self) -> None:
        """Stops every link's tasks (the sockets go with `release`)."""
        tasks = [t for link in self._links for t in link.tasks] + self._returns
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in self._links:
            link.tasks = []

    # -- calls --------------------------------------------------------------------------------
    async def _read(self, i: int) -> None:
        link = self._links[i]
        while True:
            body = (await link.sock.recv_multipart())[-1]
            try:
                msg = P.server_decoder.decode(body)
            except Exception as e:
                log.error("undecodable message from %s: %s", link.url, e)
                continue
            q = self._queues.get((i, msg.call_id))
            if q is not None:
                q.put_nowait(msg)
            elif msg.call_id == -1:
                log.error("sidecar %s could not read a message: %s", link.url, getattr(msg, "error", msg))

    async def send(self, i: int, call_type, **fields) -> tuple[int, asyncio.Queue]:
        """Sends sidecar i one call; its answers come on the queue (read them with `next`/`reply`)."""
        link = self._links[i]
        if link.state == DROPPED:
            raise SidecarGoneError(link.url, link.reason)
        self.start()
        call_id = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[(i, call_id)] = q
        await link.sock.send(P.encoder.encode(call_type(call_id=call_id, token=self.token, **fields)))
        return call_id, q

    def forget(self, i: int, call_id: int) -> None:
        """Call `call_id` of sidecar i is over: answers that still come are let go."""
        self._queues.pop((i, call_id), None)

    async def give_up(self, i: int, call_id: int) -> None:
        """Tell sidecar i this client gave up on its call `call_id` (best effort: a sidecar that is
        gone has nothing left to abort)."""
        link = self._links[i]
        if link.state == DROPPED:
            return
        try:
            cancel = P.Cancel(call_id=next(self._ids), target=call_id, token=self.token)
            await link.sock.send(P.encoder.encode(cancel), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("could not cancel call %d on %s: %s", call_id, link.url, e)

    async def next(self, i: int, q: asyncio.Queue, what: str, timeout: float | None = None):
        """The next answer on a call's queue; raises TimeoutError, or SidecarGoneError if the sidecar went."""
        try:
            msg = await asyncio.wait_for(q.get(), timeout or self.timeout_s)
        except asyncio.TimeoutError:
            try:  # a loop that did not run for a while (a blocking client's, during a training step) may
                msg = await asyncio.wait_for(q.get(), 1.0)  # see its timer before the answer that came
            except asyncio.TimeoutError:
                msg = None
        if msg is None:
            raise TimeoutError(f"{what}: no answer from sidecar {self._links[i].url} "
                               f"in {timeout or self.timeout_s:.0f}s")
        if isinstance(msg, BaseException):  # the sidecar went (drop)
            raise msg
        return msg

    async def reply(self, i: int, call_id: int, q: asyncio.Queue, what: str, timeout: float | None = None) -> Any:
        """The value of call `call_id`'s reply; SidecarError with the sidecar's reason if it failed."""
        try:
            while True:
                msg = await self.next(i, q, what, timeout)
                if isinstance(msg, P.Reply):
                    if not msg.ok:
                        raise SidecarError(f"{what} failed on {self._links[i].url}: {msg.error}", msg.error_kind)
                    return msg.value
        finally:
            self.forget(i, call_id)

    async def call(self, i: int, call_type, what: str, timeout: float | None = None, **fields) -> Any:
        call_id, q = await self.send(i, call_type, **fields)
        return await self.reply(i, call_id, q, what, timeout)

    async def call_all(self, call_type, what: str, timeout: float | None = None, states=(ACTIVE, JOINING),
                       **fields) -> list:
        """One answer per sidecar in `states`, in order. A sidecar that goes during the call is left
        out (it was dropped, with a warning); none left is an error."""
        return [a for _, a in await self.ask_all(call_type, what, timeout, states, **fields)]

    async def ask_all(self, call_type, what: str, timeout: float | None, states, **fields) -> list[tuple[int, Any]]:
        """call_all's answers, each with the sidecar it came from."""
        sent = []
        for i in self.members(*states):
            try:
                sent.append((i, *await self.send(i, call_type, **fields)))
            except SidecarGoneError:
                pass
        replies = await asyncio.gather(*(self.reply(i, cid, q, what, timeout) for i, cid, q in sent),
                                       return_exceptions=True)
        for r in replies:
            if isinstance(r, BaseException) and not isinstance(r, SidecarGoneError):
                raise r
        answers = [(i, r) for (i, _, _), r in zip(sent, replies) if not isinstance(r, SidecarGoneError)]
        if not answers:
            raise SidecarError(f"{what}: no sidecar left ({self.gone_reasons()})", "gone")
        return answers


def _release_sockets(ctx: zmq.Context, socks: list) -> None:
    for s in socks:
        s.close(0)
    ctx.term()
