"""The trainer's side: `AsyncRolloutClient` (asyncio): its sidecar links, calls, generation and
status here; its weight-sync calls in rollout/client_weights.py; its blocking twin
`RolloutClient` in rollout/blocking_client.py.

One client can drive several sidecars: prompts are spread over them, and one weight-sync group
spans them all (the trainer is rank 0; each sidecar's workers take the next ranks). The set is
elastic: `add_sidecar` mid-run is caught up from a live sidecar (rollout.peer_send) and joins the
group at the next push; a sidecar that dies is dropped with a
warning, its prompts re-sent to the others and the next push formed without it
(rollout.sidecar_link says how a death is noticed).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from engine.sampling_params import SamplingParams
from rollout import protocol as P
from rollout.client_weights import DELTA_ANCHOR_EVERY, WeightSyncCalls
from rollout.sidecar_link import ACTIVE, CATCHING_UP, DROPPED, JOINING, SidecarError, SidecarGoneError, SidecarLink
from rollout.types import Rollout

log = logging.getLogger(__name__)


def _params_wire(params, n_prompts: int):
    params = params or SamplingParams()
    if isinstance(params, list):
        if len(params) != n_prompts:
            raise ValueError(f"{len(params)} sampling params for {n_prompts} prompts")
        return [p.to_dict() for p in params]
    return params.to_dict()


def _generate_inputs(prompts, sampling_params) -> tuple[list, Any]:
    """generate_iter's prompts as a list (one conversation is one prompt) and their params' wire form."""
    from engine.inputs import is_conversation

    if is_conversation(prompts):  # one conversation, not a list of dict prompts
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty list")
    return prompts, _params_wire(sampling_params, len(prompts))


def _chunks(indices: list[int], k: int) -> list[list[int]]:
    """`indices` cut into k contiguous parts of near-equal size (some empty when fewer than k)."""
    n = len(indices)
    return [indices[n * j // k:n * (j + 1) // k] for j in range(k)]


class AsyncRolloutClient(WeightSyncCalls):
    def __init__(self, urls: str | list[str], token: str = "", timeout_s: float = 600.0):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("no sidecar address")
        self.single = len(urls) == 1  # stats()/health() of the blocking client answer a dict, not a list
        self.token = token
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        # a client dropped without close() must not leave its context to Context.__del__, whose
        # term() blocks forever on sockets still open: close them (LINGER 0) when it goes
        self._socks: list = []  # every socket ever opened, for the finalizer (links added later too)
        self._release = weakref.finalize(self, _release_sockets, self._ctx, self._socks)
        self._links: list[SidecarLink] = []  # indexed for good: a dropped one keeps its place
        for url in urls:
            self._connect(url, ACTIVE)
        self._ids = itertools.count()
        self._queues: dict[tuple[int, int], asyncio.Queue] = {}
        self.sender = None  # weight_sync.WeightSender once init_weight_sync ran
        self._init_args: dict | None = None  # init_weight_sync's arguments, until close_weight_sync
        self._members: tuple[int, ...] = ()  # the links in the current weight-sync group
        self._pushed: int | None = None  # the newest version this client pushed
        self._pending_push = None  # a push_weights(wait=False) still swapping (its asyncio.Task)
        # Delta pushes (weight_sync/common/delta_push.py): the full weights go every this many pushes, and
        # whenever the group is new (a sidecar joined, went, was healed, or a push failed)
        self.delta_anchor_every = DELTA_ANCHOR_EVERY
        self._since_anchor: int | None = None  # deltas since the last full push (None: the next is full)

    @property
    def urls(self) -> list[str]:
        """The sidecars in use (active or joining), in the order they were given."""
        return [link.url for link in self._links if link.state != DROPPED]

    @property
    def states(self) -> dict[str, str]:
        """Each sidecar in use and its state (rollout.sidecar_link): "active" ones take prompts;
        "catching up" and "joining" ones wait for the newest weights."""
        return {link.url: link.state for link in self._links if link.state != DROPPED}

    def _in(self, *states: str) -> list[int]:
        return [i for i, link in enumerate(self._links) if link.state in states]

    # -- plumbing -----------------------------------------------------------------------------
    def _connect(self, url: str, state: str) -> int:
        link = SidecarLink(self._ctx, url, state)
        self._socks.extend(link.sockets)
        self._links.append(link)
        return len(self._links) - 1

    def _start(self) -> None:
        for i, link in enumerate(self._links):
            if not link.tasks and link.state != DROPPED:
                link.tasks = [asyncio.ensure_future(self._read(i)),
                              asyncio.ensure_future(link.watch(lambda why, i=i: self._drop(i, why)))]

    def _drop(self, i: int, reason: str) -> None:
        """Sidecar i leaves for good: every call waiting on it fails with SidecarGoneError."""
        link = self._links[i]
        if link.state == DROPPED:
            return
        log.warning("sidecar %s dropped: %s; its work goes to the others", link.url, reason)
        link.state, link.reason = DROPPED, reason
        for (j, _), q in list(self._queues.items()):
            if j == i:
                q.put_nowait(SidecarGoneError(link.url, reason))
        for t in link.tasks:
            if t is not asyncio.current_task():
                t.cancel()

    def _gone_reasons(self) -> str:
        return "; ".join(f"{link.url}: {link.reason}" for link in self._links if link.state == DROPPED)

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

    async def _send(self, i: int, call_type, **fields) -> tuple[int, asyncio.Queue]:
        link = self._links[i]
        if link.state == DROPPED:
            raise SidecarGoneError(link.url, link.reason)
        self._start()
        call_id = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[(i, call_id)] = q
        await link.sock.send(P.encoder.encode(call_type(call_id=call_id, token=self.token, **fields)))
        return call_id, q

    async def _give_up(self, i: int, call_id: int) -> None:
        """Tell sidecar i this client gave up on its call `call_id` (best effort: a sidecar that is
        gone has nothing left to abort)."""
        link = self._links[i]
        if link.state == DROPPED:
            return
        try:
            await link.sock.send(P.encoder.encode(P.Cancel(call_id=next(self._ids), target=call_id, token=self.token)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("could not cancel call %d on %s: %s", call_id, link.url, e)

    async def _next(self, i: int, q: asyncio.Queue, what: str, timeout: float | None = None):
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
        if isinstance(msg, BaseException):  # the sidecar went (_drop)
            raise msg
        return msg

    async def _reply(self, i: int, call_id: int, q: asyncio.Queue, what: str, timeout: float | None = None) -> Any:
        try:
            while True:
                msg = await self._next(i, q, what, timeout)
                if isinstance(msg, P.Reply):
                    if not msg.ok:
                        raise SidecarError(f"{what} failed on {self._links[i].url}: {msg.error}", msg.error_kind)
                    return msg.value
        finally:
            self._queues.pop((i, call_id), None)

    async def _call_all(self, call_type, what: str, timeout: float | None = None, states=(ACTIVE, JOINING),
                        **fields) -> list:
        """One answer per sidecar in `states`, in order. A sidecar that goes during the call is left
        out (it was dropped, with a warning); none left is an error."""
        return [a for _, a in await self._ask_all(call_type, what, timeout, states, **fields)]

    async def _ask_all(self, call_type, what: str, timeout: float | None, states, **fields) -> list[tuple[int, Any]]:
        """_call_all's answers, each with the sidecar it came from."""
        sent = []
        for i in self._in(*states):
            try:
                sent.append((i, *await self._send(i, call_type, **fields)))
            except SidecarGoneError:
                pass
        replies = await asyncio.gather(*(self._reply(i, cid, q, what, timeout) for i, cid, q in sent),
                                       return_exceptions=True)
        for r in replies:
            if isinstance(r, BaseException) and not isinstance(r, SidecarGoneError):
                raise r
        answers = [(i, r) for (i, _, _), r in zip(sent, replies) if not isinstance(r, SidecarGoneError)]
        if not answers:
            raise SidecarError(f"{what}: no sidecar left ({self._gone_reasons()})", "gone")
        return answers

    async def _settled_health(self, timeout_s: float) -> list[tuple[int, dict]]:
        """Each sidecar's health once none has an engine restarting or a push winding down (a
        group formed before would leave that engine out), waiting at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = await self._ask_all(P.Health, "health", 30, (ACTIVE, JOINING))
            busy = [self._links[i].url for i, h in health
                    if h.get("pushing") or any(s["state"] == "restarting" for s in h.get("engine_states", ()))]
            if not busy or time.monotonic() > deadline:
                return health
            log.info("waiting for the engines of %s to settle before forming a weight-sync group", ", ".join(busy))
            await asyncio.sleep(0.2)

    # -- generation ---------------------------------------------------------------------------
    async def generate_iter(self, prompts: list, sampling_params=None) -> AsyncIterator[tuple[int, list[Rollout]]]:
        """Yields (prompt index, its n rollouts) as each group finishes. Prompts are spread over
        the active sidecars in contiguous chunks; the unfinished prompts of a sidecar that goes
        are re-sent to the others. A prompt is a string, token ids, or a conversation (a list of
        {"role", "content"} messages, put through the model's chat template)."""
        spread = _Spread(self, *_generate_inputs(prompts, sampling_params))
        try:
            await spread.submit(list(range(len(spread.prompts))))
            while spread.calls:
                i, cid, msg = await spread.merged.get()
                if isinstance(msg, P.GroupOut):
                    yield spread.finished(i, cid, msg.index), msg.rollouts
                else:
                    await spread.call_ended(i, cid, msg)
        finally:
            await spread.close()

    async def generate(self, prompts: list, sampling_params=None) -> list[list[Rollout]]:
        """One list of n rollouts per prompt, in prompt order."""
        from engine.inputs import is_conversation

        if is_conversation(prompts):
            prompts = [prompts]
        groups: list = [None] * len(prompts)
        async for idx, rollouts in self.generate_iter(prompts, sampling_params):
            groups[idx] = rollouts
        return groups

    # -- weights ------------------------------------------------------------------------------
    async def add_sidecar(self, url: str, wait: bool = False) -> None:
        """A sidecar added mid-run. It serves only once it holds the newest weights: at once when
        the others serve their checkpoint (version 0); else a live sidecar sends it its newest
        committed weights (rollout.peer_send: over their links, not the trainer's) while the
        trainer's pushes go on without it, and it serves once it holds the version this client
        pushed last. With no live sidecar to take them from, it joins at the next push (which forms
        a new group with it: no init_weight_sync needed). `wait=True`: returns once it serves or
        waits for that push."""
        if url in self.urls:
            raise ValueError(f"sidecar {url} is already in use")
        self.single = False
        newest = await self._newest_version()
        i = self._connect(url, ACTIVE if not newest else CATCHING_UP)
        self._start()
        if newest:
            asked = asyncio.Event()
            task = asyncio.ensure_future(self._catch_up(i, asked))
            self._links[i].tasks.append(task)  # dropped with the sidecar, cancelled at close
            waiter = asyncio.ensure_future(asked.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)  # its peer has been asked
            waiter.cancel()
            if wait:
                await asyncio.shield(task)
        log.info("sidecar %s added (%s)", url, self._links[i].state)

    async def _newest_version(self) -> int:
        """The version a sidecar must hold to serve: the one this client pushed last, else the
        newest its active sidecars hold (another client pushed it)."""
        if self._pushed is not None:
            return self._pushed
        if not self._in(ACTIVE):
            return 0
        return max(s["version"] for s in await self._call_all(P.Stats, "stats", 30, states=(ACTIVE,)))

    async def remove_sidecar(self, url: str) -> None:
        """Stops using a sidecar (its group membership ends at the next push); it keeps running."""
        for i, link in enumerate(self._links):
            if link.url == url and link.state != DROPPED:
                self._drop(i, "removed by the client")
                return
        raise ValueError(f"sidecar {url} is not in use")

    # -- sharing a GPU ------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Every engine frees its KV cache (level 1) or its weights too (level 2), for a trainer
        that shares the GPU; rollouts in flight are resubmitted and wait for `wake_up()`. After
        level 2 the engines hold the checkpoint again (version 0): push before generating."""
        await self._call_all(P.Sleep, "sleep", level=int(level))

    async def wake_up(self) -> None:
        await self._call_all(P.WakeUp, "wake_up")

    # -- status -------------------------------------------------------------------------------
    async def stats(self) -> list[dict]:
        return await self._call_all(P.Stats, "stats", timeout=30)

    async def health(self) -> list[dict]:
        return await self._call_all(P.Health, "health", timeout=30)

    async def close(self) -> None:
        if self._pending_push is not None:
            self._pending_push.cancel()  # its sidecars finish their swap on their own
        tasks = [t for link in self._links for t in link.tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in self._links:
            link.tasks = []
        if self.sender is not None:
            self.sender.close_group()
            self.sender = None
        self._release()


class _Spread:
    """One generate_iter call's prompts spread over the sidecars: which call carries which
    prompts, and one queue into which a pump per call forwards its answers (or its error)."""

    def __init__(self, client: AsyncRolloutClient, prompts: list, wire):
        self.client, self.prompts, self.wire = client, prompts, wire
        self.merged: asyncio.Queue = asyncio.Queue()
        self.calls: dict[tuple[int, int], list[int]] = {}  # (sidecar, call id) -> the prompts it carries
        self.done: set[int] = set()
        self._sent: list[tuple[int, int]] = []
        self._pumps: list[asyncio.Task] = []

    async def submit(self, indices: list[int]) -> None:
        """Sends prompts `indices` over the active sidecars; a part whose sidecar is gone goes round again."""
        while indices:
            serving = self.client._in(ACTIVE)
            if not serving:
                raise SidecarError(f"generate: no sidecar left to serve ({self.client._gone_reasons()})", "gone")
            left = []
            for i, part in zip(serving, _chunks(indices, len(serving))):
                if part and not await self._send(i, part):
                    left += part
            indices = left

    async def _send(self, i: int, part: list[int]) -> bool:
        """One Generate call of prompts `part` to sidecar i, with its pump; False if the sidecar is gone."""
        params = [self.wire[x] for x in part] if isinstance(self.wire, list) else self.wire
        try:
            cid, q = await self.client._send(i, P.Generate, prompts=[self.prompts[x] for x in part], params=params)
        except SidecarGoneError:
            return False
        self.calls[(i, cid)] = part
        self._sent.append((i, cid))
        self._pumps.append(asyncio.ensure_future(self._pump(i, cid, q)))
        return True

    async def _pump(self, i: int, cid: int, q: asyncio.Queue) -> None:
        try:
            while True:
                msg = await self.client._next(i, q, "generate")
                await self.merged.put((i, cid, msg))
                if isinstance(msg, P.Reply):
                    return
        except Exception as e:  # a timeout or a dropped sidecar must reach the consumer
            await self.merged.put((i, cid, e))

    def finished(self, i: int, cid: int, index: int) -> int:
        """The prompt index of group `index` of call (i, cid), now done."""
        idx = self.calls[(i, cid)][index]
        self.done.add(idx)
        return idx

    async def call_ended(self, i: int, cid: int, msg) -> None:
        """Call (i, cid) ended: its sidecar went (its unfinished prompts are re-sent), it failed
        (raised here), or it finished (forgotten)."""
        if isinstance(msg, P.Reply) and not msg.ok and msg.error_kind == "gone" and len(self.client._in(ACTIVE)) > 1:
            # the sidecar is shutting down or has no engine left: the others take its prompts
            self.client._drop(i, msg.error)
            msg = SidecarGoneError(self.client._links[i].url, msg.error)
        if isinstance(msg, SidecarGoneError):
            rest = [x for x in self.calls.pop((i, cid)) if x not in self.done]
            log.warning("re-sending %d unfinished prompts of %s to the other sidecars", len(rest), msg.url)
            await self.submit(rest)
        elif isinstance(msg, Exception):
            raise msg
        elif not msg.ok:
            raise SidecarError(f"generate failed on {self.client._links[i].url}: {msg.error}", msg.error_kind)
        else:
            del self.calls[(i, cid)]

    async def close(self) -> None:
        """Stops the pumps, tells each sidecar of a call still open that its caller gave up (a
        timeout, a cancelled task, a consumer that stopped reading: the sidecar aborts its
        requests), and forgets the calls' queues."""
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)  # let the cancellations land
        for i, cid in list(self.calls):
            await self.client._give_up(i, cid)
        for key in self._sent:
            self.client._queues.pop(key, None)


def _release_sockets(ctx: zmq.Context, socks: list) -> None:
    for s in socks:
        s.close(0)
    ctx.term()
