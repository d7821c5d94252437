"""The trainer's side: `AsyncRolloutClient` (asyncio) and `RolloutClient` (blocking twin).

One client can drive several sidecars: prompts are spread over them, and one weight-sync group
spans them all (the trainer is rank 0; each sidecar's workers take the next ranks).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import zmq
import zmq.asyncio

from engine.sampling_params import SamplingParams
from rollout import protocol as P
from rollout.types import Rollout

log = logging.getLogger(__name__)


class SidecarError(RuntimeError):
    """A sidecar refused or failed a call; the message is the sidecar's reason, `kind` how it
    failed, as the sidecar said it (protocol.ERROR_KINDS; "" when not the sidecar's word)."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


def _params_wire(params, n_prompts: int):
    params = params or SamplingParams()
    if isinstance(params, list):
        if len(params) != n_prompts:
            raise ValueError(f"{len(params)} sampling params for {n_prompts} prompts")
        return [p.to_dict() for p in params]
    return params.to_dict()


class AsyncRolloutClient:
    def __init__(self, urls: str | list[str], token: str = "", timeout_s: float = 600.0):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("no sidecar address")
        self.token = token
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._socks = []
        for url in self.urls:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(url)
            self._socks.append(s)
        # a client dropped without close() must not leave its context to Context.__del__, whose
        # term() blocks forever on sockets still open: close them (LINGER 0) when it goes
        self._release = weakref.finalize(self, _release_sockets, self._ctx, list(self._socks))
        self._ids = itertools.count()
        self._queues: dict[tuple[int, int], asyncio.Queue] = {}
        self._readers: list[asyncio.Task] = []
        self.sender = None  # weight_sync.WeightSender once init_weight_sync ran
        self._init_args: dict | None = None  # init_weight_sync's arguments, until close_weight_sync

    # -- plumbing -----------------------------------------------------------------------------
    def _start(self) -> None:
        if not self._readers:
            self._readers = [asyncio.ensure_future(self._read(i)) for i in range(len(self._socks))]

    async def _read(self, i: int) -> None:
        while True:
            body = (await self._socks[i].recv_multipart())[-1]
            try:
                msg = P.server_decoder.decode(body)
            except Exception as e:
                log.error("undecodable message from %s: %s", self.urls[i], e)
                continue
            q = self._queues.get((i, msg.call_id))
            if q is not None:
                q.put_nowait(msg)
            elif msg.call_id == -1:
                log.error("sidecar %s could not read a message: %s", self.urls[i], getattr(msg, "error", msg))

    async def _send(self, i: int, call_type, **fields) -> tuple[int, asyncio.Queue]:
        self._start()
        call_id = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[(i, call_id)] = q
        await self._socks[i].send(P.encoder.encode(call_type(call_id=call_id, token=self.token, **fields)))
        return call_id, q

    async def _next(self, i: int, q: asyncio.Queue, what: str, timeout: float | None = None):
        try:
            return await asyncio.wait_for(q.get(), timeout or self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what}: no answer from sidecar {self.urls[i]} in {timeout or self.timeout_s:.0f}s")

    async def _reply(self, i: int, call_id: int, q: asyncio.Queue, what: str, timeout: float | None = None) -> Any:
        try:
            while True:
                msg = await self._next(i, q, what, timeout)
                if isinstance(msg, P.Reply):
                    if not msg.ok:
                        raise SidecarError(f"{what} failed on {self.urls[i]}: {msg.error}", msg.error_kind)
                    return msg.value
        finally:
            self._queues.pop((i, call_id), None)

    async def _call_all(self, call_type, what: str, timeout: float | None = None, **fields) -> list:
        sent = [(i, *await self._send(i, call_type, **fields)) for i in range(len(self._socks))]
        return await asyncio.gather(*(self._reply(i, cid, q, what, timeout) for i, cid, q in sent))

    # -- generation ---------------------------------------------------------------------------
    async def generate_iter(self, prompts: list, sampling_params=None) -> AsyncIterator[tuple[int, list[Rollout]]]:
        """Yields (prompt index, its n rollouts) as each group finishes. Prompts are spread over
        the sidecars in contiguous chunks. A prompt is a string, token ids, or a conversation (a
        list of {"role", "content"} messages, put through the model's chat template)."""
        from engine.inputs import is_conversation

        if is_conversation(prompts):  # one conversation, not a list of dict prompts
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty list")
        wire = _params_wire(sampling_params, len(prompts))
        k = len(self._socks)
        chunks = [(i, range(len(prompts) * i // k, len(prompts) * (i + 1) // k)) for i in range(k)]
        chunks = [(i, r) for i, r in chunks if len(r)]
        sent = []
        for i, r in chunks:
            p = wire[r.start:r.stop] if isinstance(wire, list) else wire
            sent.append((i, r, *await self._send(i, P.Generate, prompts=[prompts[j] for j in r], params=p)))
        open_calls = {(i, cid): (r, q) for i, r, cid, q in sent}
        try:
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(i, cid, q):
                try:
                    while True:
                        msg = await self._next(i, q, "generate")
                        await merged.put((i, msg))
                        if isinstance(msg, P.Reply):
                            return
                except Exception as e:  # a timeout (dead or silent sidecar) must reach the consumer
                    await merged.put((i, e))

            pumps = [asyncio.ensure_future(pump(i, cid, q)) for i, _, cid, q in sent]
            try:
                while open_calls:
                    i, msg = await merged.get()
                    if isinstance(msg, Exception):
                        raise msg
                    r, _ = open_calls[(i, msg.call_id)]
                    if isinstance(msg, P.GroupOut):
                        yield r.start + msg.index, msg.rollouts
                    elif not msg.ok:
                        raise SidecarError(f"generate failed on {self.urls[i]}: {msg.error}", msg.error_kind)
                    else:
                        del open_calls[(i, msg.call_id)]
            finally:
                for t in pumps:
                    t.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)  # let the cancellations land
        finally:
            for i, _, cid, _ in sent:
                self._queues.pop((i, cid), None)

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
    async def init_weight_sync(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0,
                               bucket_bytes: int | None = None, device=None, take_over: bool = False) -> dict:
        """Form one weight-sync group with every sidecar's workers; this trainer is rank 0.
        One trainer owns a sidecar's weight sync at a time: while another one's group is open and
        its trainer alive, this raises SidecarError (kind "refused") unless `take_over=True`."""
        from rollout.weights import owned_message
        from weight_sync.sender import WeightSender

        health = await self.health()
        for url, h in zip(self.urls, health):
            owner = h.get("weight_sync_owner")
            group = self.sender.group if self.sender is not None else None
            mine = group is not None and owner and owner["group_name"] == group.group_name
            if owner and owner["alive"] and not take_over and not mine:  # refused before opening a group
                raise SidecarError(f"init_weight_sync refused by {url}: {owned_message(owner['group_name'])}",
                                   "refused")
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
                                      rank_offset=offsets[i], group_name=info["group_name"], timeout_s=timeout_s,
                                      secret=info["secret"], take_over=take_over))
                for i in range(len(self._socks))]
        join = asyncio.ensure_future(asyncio.to_thread(self.sender.join_group))
        replies = await asyncio.gather(*(self._reply(i, cid, q, "init_weight_sync", timeout_s + 60)
                                         for i, cid, q in sent), return_exceptions=True)
        joined = (await asyncio.gather(join, return_exceptions=True))[0]
        errors = [r for r in replies if isinstance(r, BaseException)]
        if errors or isinstance(joined, BaseException):
            self.sender.close_group()
            raise SidecarError("init_weight_sync failed: " + "; ".join(str(e) for e in errors or [joined]))
        return {"world_size": world, "rank_offsets": offsets, **{k: v for k, v in info.items() if k != "secret"}}

    async def push_weights(self, model_or_named_tensors, version: int, pause_mode: str | None = None,
                           timeout_s: float = 300.0, progress=None, transport: str = "group") -> dict:
        """Pause every sidecar, broadcast the weights, commit, resume (weight_sync.push.run_push,
        delivered as a `push_weights` call to each sidecar). Raises SidecarError with the
        sidecars' reasons (and the trainer's) on any failure; the previous weights then keep
        serving. `progress(bucket, n_buckets)` is called (in a worker thread) as each bucket goes out.
        `transport="shared"`: sidecars on this machine read the weights from memory the trainer
        shares (weight_sync.shared; `flatten_parameters(model, shared=True)` first): no group,
        no init_weight_sync; colocated on one GPU, this is the way (CUDA IPC)."""
        from weight_sync.push import run_push

        if transport == "shared":
            return await self._push_shared(model_or_named_tensors, version, pause_mode, timeout_s)
        if transport != "group":
            raise ValueError(f"transport must be 'group' or 'shared', got {transport!r}")
        if self.sender is not None and self.sender.group is None and self._init_args is not None:
            # the last push failed and closed the group (e.g. an engine died in it): form a new one
            await self.init_weight_sync(**self._init_args, take_over=True)
        if self.sender is None or self.sender.group is None:
            raise SidecarError("init_weight_sync() first")

        def deliver(manifest) -> list:
            group_name = self.sender.group.group_name
            return [(self.urls[i], self._push_call(i, manifest.to_wire(), pause_mode, timeout_s, group_name))
                    for i in range(len(self._socks))]

        outcome = await run_push(self.sender, model_or_named_tensors, version, deliver, timeout_s + 60, progress)
        if outcome.regroup:  # a sidecar's engines changed (one was restarted): a new group, and once more
            log.warning("a sidecar's engines changed since the weight-sync group formed: forming a new group")
            await self.init_weight_sync(**self._init_args, take_over=True)
            outcome = await run_push(self.sender, model_or_named_tensors, version, deliver, timeout_s + 60, progress)
        if outcome.errors:
            raise SidecarError(f"push of version {version} failed: " + " | ".join(outcome.errors),
                               "refused" if outcome.refused else "")
        return {"version": version, "trainer": outcome.trainer, "sidecars": outcome.results}

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
        sent = [(i, *await self._send(i, P.PushWeights, manifest=wire, pause_mode=pause_mode or "",
                                      timeout_s=timeout_s, shared=shared)) for i in range(len(self._socks))]
        replies = await asyncio.gather(*(self._reply(i, cid, q, "push_weights", timeout_s + 60) for i, cid, q in sent),
                                       return_exceptions=True)
        errors = [str(r) for r in replies if isinstance(r, BaseException)]
        if errors:
            raise SidecarError(f"push of version {version} failed: " + " | ".join(errors))
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
        return await self._call_all(P.LoadWeights, "load_weights", timeout_s, path=str(path), version=int(version),
                                    pause_mode=pause_mode or "")

    async def close_weight_sync(self) -> None:
        await self._call_all(P.CloseWeightSync, "close_weight_sync")
        self._init_args = None
        if self.sender is not None:
            self.sender.close_group()

    def checksum_of(self, model_or_named_tensors) -> str:
        """The checksum every engine's `weights_checksums()` entry equals after pushing this
        model (in the push's dtype); for checking a push."""
        if self.sender is None:
            raise SidecarError("init_weight_sync() first")
        return self.sender.checksum(model_or_named_tensors)

    async def weights_checksums(self) -> list[str]:
        """Every worker's weights checksum, sidecars in order (compare with WeightSender.checksum)."""
        return [c for per in await self._call_all(P.Checksum, "checksum", timeout=120) for c in per]

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
        for t in self._readers:
            t.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self._readers = []
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
        return s[0] if len(s) == 1 else s

    def health(self) -> list[dict] | dict:
        h = self._run(self._client.health())
        return h[0] if len(h) == 1 else h

    def close(self) -> None:
        self._abandon()  # the same steps as for a dropped client, once

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


async def _make(urls, token, timeout_s) -> AsyncRolloutClient:
    return AsyncRolloutClient(urls, token, timeout_s)
