"""The trainer's side: `AsyncRolloutClient` (asyncio) and `RolloutClient` (blocking twin).

One client can drive several sidecars: prompts are spread over them, and one weight-sync group
spans them all (the trainer is rank 0; each sidecar's workers take the next ranks). The set is
elastic: `add_sidecar` mid-run joins at the next push; a sidecar that dies is dropped with a
warning, its prompts re-sent to the others and the next push formed without it
(rollout.sidecar_link says how a death is noticed).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import zmq
import zmq.asyncio

from engine.sampling_params import SamplingParams
from rollout import protocol as P
from rollout.sidecar_link import ACTIVE, DROPPED, JOINING, SidecarError, SidecarGoneError, SidecarLink
from rollout.types import Rollout

log = logging.getLogger(__name__)


def _params_wire(params, n_prompts: int):
    params = params or SamplingParams()
    if isinstance(params, list):
        if len(params) != n_prompts:
            raise ValueError(f"{len(params)} sampling params for {n_prompts} prompts")
        return [p.to_dict() for p in params]
    return params.to_dict()


class AsyncRolloutClient:
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

    @property
    def urls(self) -> list[str]:
        """The sidecars in use (active or joining), in the order they were given."""
        return [link.url for link in self._links if link.state != DROPPED]

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

    async def _next(self, i: int, q: asyncio.Queue, what: str, timeout: float | None = None):
        try:
            msg = await asyncio.wait_for(q.get(), timeout or self.timeout_s)
        except asyncio.TimeoutError:
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
        from engine.inputs import is_conversation

        if is_conversation(prompts):  # one conversation, not a list of dict prompts
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty list")
        wire = _params_wire(sampling_params, len(prompts))
        merged: asyncio.Queue = asyncio.Queue()
        calls: dict[tuple[int, int], list[int]] = {}  # (sidecar, call id) -> the prompts it carries
        sent: list[tuple[int, int]] = []
        pumps: list[asyncio.Task] = []

        async def pump(i, cid, q):
            try:
                while True:
                    msg = await self._next(i, q, "generate")
                    await merged.put((i, cid, msg))
                    if isinstance(msg, P.Reply):
                        return
            except Exception as e:  # a timeout or a dropped sidecar must reach the consumer
                await merged.put((i, cid, e))

        async def submit(indices: list[int]) -> None:
            while indices:
                serving = self._in(ACTIVE)
                if not serving:
                    raise SidecarError(f"generate: no sidecar left to serve ({self._gone_reasons()})", "gone")
                k, left = len(serving), []
                for j, i in enumerate(serving):
                    part = indices[len(indices) * j // k:len(indices) * (j + 1) // k]
                    if not part:
                        continue
                    p = [wire[x] for x in part] if isinstance(wire, list) else wire
                    try:
                        cid, q = await self._send(i, P.Generate, prompts=[prompts[x] for x in part], params=p)
                    except SidecarGoneError:
                        left += part
                        continue
                    calls[(i, cid)] = part
                    sent.append((i, cid))
                    pumps.append(asyncio.ensure_future(pump(i, cid, q)))
                indices = left

        try:
            await submit(list(range(len(prompts))))
            done: set[int] = set()
            while calls:
                i, cid, msg = await merged.get()
                if isinstance(msg, SidecarGoneError):
                    rest = [x for x in calls.pop((i, cid)) if x not in done]
                    log.warning("re-sending %d unfinished prompts of %s to the other sidecars", len(rest), msg.url)
                    await submit(rest)
                elif isinstance(msg, Exception):
                    raise msg
                elif isinstance(msg, P.GroupOut):
                    idx = calls[(i, cid)][msg.index]
                    done.add(idx)
                    yield idx, msg.rollouts
                elif not msg.ok:
                    raise SidecarError(f"generate failed on {self._links[i].url}: {msg.error}", msg.error_kind)
                else:
                    del calls[(i, cid)]
        finally:
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)  # let the cancellations land
            for key in sent:
                self._queues.pop(key, None)

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
    async def add_sidecar(self, url: str) -> None:
        """A sidecar added mid-run. It serves only once it holds the newest weights: at once when
        this client has pushed none yet, else after the next push, which forms a new group with
        it (no init_weight_sync needed)."""
        if url in self.urls:
            raise ValueError(f"sidecar {url} is already in use")
        self.single = False
        i = self._connect(url, ACTIVE if self._pushed is None else JOINING)
        self._start()
        log.info("sidecar %s added (%s)", url, self._links[i].state)

    async def remove_sidecar(self, url: str) -> None:
        """Stops using a sidecar (its group membership ends at the next push); it keeps running."""
        for i, link in enumerate(self._links):
            if link.url == url and link.state != DROPPED:
                self._drop(i, "removed by the client")
                return
        raise ValueError(f"sidecar {url} is not in use")

    async def init_weight_sync(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0,
                               bucket_bytes: int | None = None, device=None, take_over: bool = False) -> dict:
        """Form one weight-sync group with every sidecar's workers; this trainer is rank 0.
        One trainer owns a sidecar's weight sync at a time: while another one's group is open and
        its trainer alive, this raises SidecarError (kind "refused") unless `take_over=True`.
        A joining sidecar (add_sidecar) that cannot join is dropped with a warning instead."""
        from rollout.weights import owned_message
        from weight_sync.sender import WeightSender

        group = self.sender.group if self.sender is not None else None
        members, health = [], []
        for i, h in await self._settled_health(timeout_s):
            owner = h.get("weight_sync_owner")
            mine = group is not None and owner and owner["group_name"] == group.group_name
            if owner and owner["alive"] and not take_over and not mine:  # refused before opening a group
                why = owned_message(owner["group_name"])
                if self._links[i].state == JOINING:
                    self._drop(i, f"could not join: {why}")
                    continue
                raise SidecarError(f"init_weight_sync refused by {self._links[i].url}: {why}", "refused")
            members.append(i)
            health.append(h)
        self._init_args = {"host": host, "port": port, "timeout_s": timeout_s, "bucket_bytes": bucket_bytes,
                           "device": device}  # a regroup forms the next group the same way
        workers = [h["workers"] for h in health]
        world = 1 + sum(workers)
        if self.sender is None:
            kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
            self.sender = WeightSender(device=device, timeout_s=timeout_s, **kw)
        info = self.sender.open_group(world, host=host, port=port, timeout_s=timeout_s)
        offsets = list(itertools.accumulate([1] + workers[:-1]))
        sent = [(i, *await self._send(i, P.InitWeightSync, host=info["host"], port=info["port"], world_size=world,
                                      rank_offset=offset, group_name=info["group_name"], timeout_s=timeout_s,
                                      secret=info["secret"], take_over=take_over))
                for i, offset in zip(members, offsets)]
        join = asyncio.ensure_future(asyncio.to_thread(self.sender.join_group))
        replies = await asyncio.gather(*(self._reply(i, cid, q, "init_weight_sync", timeout_s + 60)
                                         for i, cid, q in sent), return_exceptions=True)
        joined = (await asyncio.gather(join, return_exceptions=True))[0]
        errors = [r for r in replies if isinstance(r, BaseException)]
        if errors or isinstance(joined, BaseException):
            self.sender.close_group()
            raise SidecarError("init_weight_sync failed: " + "; ".join(str(e) for e in errors or [joined]))
        self._members = tuple(members)
        return {"world_size": world, "rank_offsets": offsets, **{k: v for k, v in info.items() if k != "secret"}}

    async def push_weights(self, model_or_named_tensors, version: int, pause_mode: str | None = None,
                           timeout_s: float = 300.0, progress=None, transport: str = "group") -> dict:
        """Pause every sidecar, broadcast the weights, commit, resume (weight_sync.push.run_push,
        delivered as a `push_weights` call to each sidecar). Raises SidecarError with the
        sidecars' reasons (and the trainer's) on any failure; the previous weights then keep
        serving. `progress(bucket, n_buckets)` is called (in a worker thread) as each bucket goes out.
        `transport="shared"`: sidecars on this machine read the weights from memory the trainer
        shares (weight_sync.shared; `flatten_parameters(model, shared=True)` first): no group,
        no init_weight_sync; colocated on one GPU, this is the way (CUDA IPC).
        The group follows the sidecars: one added joins it here, one that went is left out of it;
        a sidecar that goes during the push costs one more try with the others."""
        from weight_sync.push import run_push

        if transport == "shared":
            return await self._push_shared(model_or_named_tensors, version, pause_mode, timeout_s)
        if transport != "group":
            raise ValueError(f"transport must be 'group' or 'shared', got {transport!r}")
        if self.sender is None or (self.sender.group is None and self._init_args is None):
            raise SidecarError("init_weight_sync() first")

        def deliver(manifest) -> list:
            group_name = self.sender.group.group_name
            return [(self._links[i].url, self._push_call(i, manifest.to_wire(), pause_mode, timeout_s, group_name))
                    for i in self._members]

        for attempt in range(3):
            if self.sender.group is None or self._members != tuple(self._in(ACTIVE, JOINING)):
                # a new group: the last one failed and closed, or a sidecar joined or went since
                await self.init_weight_sync(**self._init_args, take_over=True)
            outcome = await run_push(self.sender, model_or_named_tensors, version, deliver, timeout_s + 60, progress)
            if not outcome.errors:
                break
            if outcome.regroup:  # a sidecar's engines changed (one was restarted): a new group, and once more
                log.warning("a sidecar's engines changed since the weight-sync group formed: forming a new group")
                self.sender.close_group()
                continue
            if not self._leave_out_failed_sidecars(outcome):
                break
        if outcome.errors:
            raise SidecarError(f"push of version {version} failed: " + " | ".join(outcome.errors),
                               "refused" if outcome.refused else "")
        self._pushed_to(self._members, version)
        return {"version": version, "trainer": outcome.trainer, "sidecars": outcome.results}

    def _leave_out_failed_sidecars(self, outcome) -> bool:
        """After a failed push: True when trying again without some sidecar can help: one went
        during the push, or one still joining failed it (dropped, with a warning)."""
        again = False
        for i, result in zip(self._members, outcome.results):
            link = self._links[i]
            if link.state == DROPPED:
                again = True
            elif link.state == JOINING and isinstance(result, BaseException):
                self._drop(i, f"could not join: {result}")
                again = True
        if again:
            log.warning("push failed (%s): once more without the sidecars that went", " | ".join(outcome.errors))
        return again

    def _pushed_to(self, members, version: int) -> None:
        """A push committed on `members`: joining ones now hold the newest weights and serve."""
        self._pushed = version
        for i in members:
            if self._links[i].state == JOINING:
                self._links[i].state = ACTIVE
                log.info("sidecar %s holds version %d and serves", self._links[i].url, version)

    async def _push_shared(self, weights, version: int, pause_mode: str | None, timeout_s: float) -> dict:
        from weight_sync.sender import WeightSender
        from weight_sync.shared import export_weights
        from weight_sync.trainer_weights import named_weights

        from weight_sync.trainer_ranks import DONE, tell_peers

        if self.sender is None:
            self.sender = WeightSender(timeout_s=timeout_s)
        try:
            prepared = self.sender.prepare(weights, version)
            with named_weights(prepared.weights) as named:
                shared = export_weights(prepared.manifest, named)
        finally:
            tell_peers(DONE)  # nothing to gather from shared memory: a trainer's other ranks stop following
        wire = prepared.manifest.to_wire()
        members = self._in(ACTIVE, JOINING)
        sent = [(i, *await self._send(i, P.PushWeights, manifest=wire, pause_mode=pause_mode or "",
                                      timeout_s=timeout_s, shared=shared)) for i in members]
        replies = await asyncio.gather(*(self._reply(i, cid, q, "push_weights", timeout_s + 60) for i, cid, q in sent),
                                       return_exceptions=True)
        errors = [str(r) for r in replies if isinstance(r, BaseException)]
        if errors:
            raise SidecarError(f"push of version {version} failed: " + " | ".join(errors))
        self._pushed_to(members, version)
        return {"version": version, "sidecars": replies}

    async def _push_call(self, i: int, manifest: dict, pause_mode: str | None, timeout_s: float,
                         group_name: str) -> dict:
        """Sidecar i pauses its engines, which receive the push in the trainer's group."""
        call_id, q = await self._send(i, P.PushWeights, manifest=manifest, pause_mode=pause_mode or "",
                                      timeout_s=timeout_s, group_name=group_name)
        return await self._reply(i, call_id, q, "push_weights", timeout_s + 60)

    async def load_weights(self, path: str, version: int, pause_mode: str | None = None,
                           timeout_s: float = 300.0) -> list[dict]:
        """The file fallback: every sidecar's engines load the push that
        `weight_sync.files.write_safetensors(model, path, version)` wrote to `path` (a directory
        every sidecar can read, e.g. under /dev/shm on one host), all or nothing per engine."""
        members = self._in(ACTIVE, JOINING)
        out = await self._call_all(P.LoadWeights, "load_weights", timeout_s, path=str(path), version=int(version),
                                   pause_mode=pause_mode or "")
        self._pushed_to([i for i in members if self._links[i].state != DROPPED], version)
        return out

    async def close_weight_sync(self) -> None:
        await self._call_all(P.CloseWeightSync, "close_weight_sync", states=(ACTIVE, JOINING))
        self._init_args = None
        self._members = ()
        if self.sender is not None:
            self.sender.close_group()

    def checksum_of(self, model_or_named_tensors) -> str:
        """The checksum every engine's `weights_checksums()` entry equals after pushing this
        model (in the push's dtype); for checking a push."""
        if self.sender is None:
            raise SidecarError("init_weight_sync() first")
        return self.sender.checksum(model_or_named_tensors)

    async def weights_checksums(self) -> list[str]:
        """Every worker's weights checksum, active sidecars in order (compare with WeightSender.checksum)."""
        return [c for per in await self._call_all(P.Checksum, "checksum", timeout=120, states=(ACTIVE,)) for c in per]

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


def _release_sockets(ctx: zmq.Context, socks: list) -> None:
    for s in socks:
        s.close(0)
    ctx.term()


def _abandon(loop: asyncio.AbstractEventLoop, client: AsyncRolloutClient) -> None:
    """A RolloutClient dropped without close(): close it on its own (idle) loop, bounded."""
    try:
        loop.run_until_complete(asyncio.wait_for(client.close(), 5))
    except Exception as e:  # noqa: BLE001 - a finalizer must not raise; the sockets go below anyway
        log.warning("closing a dropped RolloutClient: %s", e)
    client._release()
    loop.close()


class RolloutClient:
    """Blocking twin of AsyncRolloutClient (runs it on a private event loop)."""

    def __init__(self, urls: str | list[str], token: str = "", timeout_s: float = 600.0):
        self._loop = asyncio.new_event_loop()
        self._client = self._run(_make(urls, token, timeout_s))
        self._abandon = weakref.finalize(self, _abandon, self._loop, self._client)

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    @property
    def urls(self) -> list[str]:
        return self._client.urls

    def generate(self, prompts: list, sampling_params=None) -> list[list[Rollout]]:
        return self._run(self._client.generate(prompts, sampling_params))

    def generate_iter(self, prompts: list, sampling_params=None) -> Iterator[tuple[int, list[Rollout]]]:
        agen = self._client.generate_iter(prompts, sampling_params)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    def add_sidecar(self, url: str) -> None:
        self._run(self._client.add_sidecar(url))

    def remove_sidecar(self, url: str) -> None:
        self._run(self._client.remove_sidecar(url))

    def init_weight_sync(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0,
                         bucket_bytes: int | None = None, device=None, take_over: bool = False) -> dict:
        return self._run(self._client.init_weight_sync(host, port, timeout_s, bucket_bytes, device, take_over))

    def push_weights(self, model_or_named_tensors, version: int, pause_mode: str | None = None,
                     timeout_s: float = 300.0, progress=None, transport: str = "group") -> dict:
        return self._run(self._client.push_weights(model_or_named_tensors, version, pause_mode, timeout_s, progress,
                                                   transport))

    def load_weights(self, path: str, version: int, pause_mode: str | None = None,
                     timeout_s: float = 300.0) -> list[dict]:
        return self._run(self._client.load_weights(path, version, pause_mode, timeout_s))

    def close_weight_sync(self) -> None:
        self._run(self._client.close_weight_sync())

    def weights_checksums(self) -> list[str]:
        return self._run(self._client.weights_checksums())

    def checksum_of(self, model_or_named_tensors) -> str:
        return self._client.checksum_of(model_or_named_tensors)

    def sleep(self, level: int = 1) -> None:
        self._run(self._client.sleep(level))

    def wake_up(self) -> None:
        self._run(self._client.wake_up())

    def stats(self) -> list[dict] | dict:
        s = self._run(self._client.stats())
        return s[0] if self._client.single else s

    def health(self) -> list[dict] | dict:
        h = self._run(self._client.health())
        return h[0] if self._client.single else h

    def close(self) -> None:
        self._abandon()  # the same steps as for a dropped client, once

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


async def _make(urls, token, timeout_s) -> AsyncRolloutClient:
    return AsyncRolloutClient(urls, token, timeout_s)
