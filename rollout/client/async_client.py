"""The trainer's side: `AsyncRolloutClient` (asyncio), one object over its sidecars: their links
and calls (`SidecarSet`, rollout/client/sidecar_set.py), generation spread over them (rollout/client/spread.py), an
added sidecar caught up from a peer (rollout/client/catch_up.py) and the weight sync (`WeightSyncClient`,
rollout/client/weight_sync_client.py, over the same links). Its blocking twin `RolloutClient` is in
rollout/client/blocking_client.py.

One client can drive several sidecars: prompts are spread over them, and one weight-sync group
spans them all (the trainer is rank 0; each sidecar's workers take the next ranks). The set is
elastic: `add_sidecar` mid-run is caught up from a live sidecar (rollout.sidecar.peer_send) and joins the
group at the next push; a sidecar that dies is dropped with a warning, its prompts re-sent to the
others and the next push formed without it (rollout.client.sidecar_link says how a death is noticed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from rollout.common import protocol as P
from rollout.client.catch_up import catch_up
from rollout.client.sidecar_link import ACTIVE, CATCHING_UP, SidecarError
from rollout.client.sidecar_set import SidecarSet
from rollout.client.placement import Placement
from rollout.client.spread import Spread, generate_inputs, session_list
from rollout.common.types import Rollout
from rollout.client.weight_sync_client import WeightSyncClient

log = logging.getLogger(__name__)


class AsyncRolloutClient:
    def __init__(self, urls: str | list[str], token: str = "", timeout_s: float = 600.0):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("no sidecar address")
        self.single = len(urls) == 1  # stats()/health() of the blocking client answer a dict, not a list
        self.token = token
        self.timeout_s = timeout_s
        self.links = SidecarSet(urls, token, timeout_s)
        self.links.on_return = self._take_back
        self._release = self.links.release  # the sockets, closed once (also when the client is dropped)
        self.weight_sync = WeightSyncClient(self.links)
        self.placement = Placement()  # where each named session's calls go (rollout/client/placement.py)
        self.load_poll_s = 1.0  # how often the sidecars' own load is asked, while sessions are placed
        self._load_watch: asyncio.Task | None = None

    @property
    def urls(self) -> list[str]:
        """The sidecars in use (active or joining), in the order they were given."""
        return [self.links.url(i) for i in self.links.in_use()]

    @property
    def states(self) -> dict[str, str]:
        """Each sidecar in use and its state (rollout.client.sidecar_link): "active" ones take prompts;
        "catching up" and "joining" ones wait for the newest weights."""
        return {self.links.url(i): self.links.state(i) for i in self.links.in_use()}

    @property
    def sender(self):
        """The trainer's weight_sync.WeightSender, once init_weight_sync ran (else None)."""
        return self.weight_sync.sender

    @property
    def delta_anchor_every(self) -> int:
        """A delta push's full "anchor" goes every this many pushes (see push_weights' `delta`)."""
        return self.weight_sync.anchors.every

    @delta_anchor_every.setter
    def delta_anchor_every(self, n: int) -> None:
        self.weight_sync.anchors.every = n

    # -- generation ---------------------------------------------------------------------------
    async def generate_iter(self, prompts: list, sampling_params=None,
                            sessions=None) -> AsyncIterator[tuple[int, list[Rollout]]]:
        """Yields (prompt index, its n rollouts) as each group finishes. Prompts are spread over
        the active sidecars in contiguous chunks; the unfinished prompts of a sidecar that goes
        are re-sent to the others. A prompt is a string, token ids, or a conversation (a list of
        {"role", "content"} messages, put through the model's chat template). `sessions`: a name
        (an agent's episode id) for every prompt, or one name (or None) a prompt: a session's calls
        go to the sidecar that served its last one, whose prefix cache holds it
        (rollout/client/placement.py; `end_session` drops it)."""
        prompts, wire = generate_inputs(prompts, sampling_params)
        if sessions is not None and len(self.links.in_use()) > 1 and (self._load_watch is None
                                                                      or self._load_watch.done()):
            self._load_watch = asyncio.ensure_future(self._watch_load())  # (again, if a fault ended the last)
        spread = Spread(self.links, prompts, wire, session_list(sessions, len(prompts)), self.placement)
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

    async def generate(self, prompts: list, sampling_params=None, sessions=None) -> list[list[Rollout]]:
        """One list of n rollouts per prompt, in prompt order (`sessions` as generate_iter's)."""
        from engine.inputs import is_conversation

        if is_conversation(prompts):
            prompts = [prompts]
        groups: list = [None] * len(prompts)
        async for idx, rollouts in self.generate_iter(prompts, sampling_params, sessions):
            groups[idx] = rollouts
        return groups

    async def _watch_load(self) -> None:
        """Every `load_poll_s`, each active sidecar's own load (protocol.LoadReply) into the placement: the
        prompts other clients have in flight there count when sessions are placed."""
        while True:
            try:
                then = self.placement.asked()
                for i, load in await self.links.ask_all(P.Load, "load", 10, (ACTIVE,)):
                    self.placement.observe(i, load["groups"], load["kv_used"], then.get(i, (0, 0)))
            except (SidecarError, TimeoutError) as e:  # none left, or slow: placement goes on by its own counts
                log.debug("load poll: %s", e)
            await asyncio.sleep(self.load_poll_s)

    def end_session(self, session: str) -> None:
        """The session is over: its sidecar is no longer kept for it."""
        self.placement.end(session)

    def placement_stats(self) -> dict:
        """Sessions started and pinned, moves, and per sidecar URL: this client's prompts in flight, the others'
        (as the sidecar last reported) and the sessions pinned there."""
        stats = self.placement.stats()
        for key in ("busy", "others", "pinned_per_sidecar"):
            stats[key] = {self.links.url(i): n for i, n in stats[key].items()}
        return stats

    # -- the sidecars in use ----------------------------------------------------------------------
    async def add_sidecar(self, url: str, wait: bool = False) -> None:
        """A sidecar added mid-run. It serves only once it holds the newest weights: at once when
        the others serve their checkpoint (version 0); else a live sidecar sends it its newest
        committed weights (rollout.sidecar.peer_send: over their links, not the trainer's) while the
        trainer's pushes go on without it, and it serves once it holds the version this client
        pushed last. With no live sidecar to take them from, it joins at the next push (which forms
        a new group with it: no init_weight_sync needed). `wait=True`: returns once it serves or
        waits for that push."""
        if url in self.urls:
            raise ValueError(f"sidecar {url} is already in use")
        self.single = False
        await self._admit(url, wait)

    async def _take_back(self, url: str) -> None:
        """A sidecar that went answers at its address again (a new process, or its host back on
        its link): it comes back as an added one does, caught up from a peer before it serves."""
        log.warning("sidecar %s answers again: taking it back", url)
        await self._admit(url, wait=False)

    async def _admit(self, url: str, wait: bool) -> None:
        newest = await self._newest_version()
        i = self.links.connect(url, ACTIVE if not newest else CATCHING_UP)
        self.links.start()
        if newest:
            asked = asyncio.Event()
            task = asyncio.ensure_future(catch_up(self.links, i, self._newest_version, asked, self.timeout_s))
            self.links.keep_task(i, task)  # dropped with the sidecar, cancelled at close
            waiter = asyncio.ensure_future(asked.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)  # its peer has been asked
            waiter.cancel()
            if wait:
                await asyncio.shield(task)
        log.info("sidecar %s added (%s)", url, self.links.state(i))

    async def _newest_version(self) -> int:
        """The version a sidecar must hold to serve: the one this client pushed last, else the
        newest its active sidecars hold (another client pushed it)."""
        if self.weight_sync.pushed is not None:
            return self.weight_sync.pushed
        if not self.links.members(ACTIVE):
            return 0
        return max(s["version"] for s in await self.links.call_all(P.Stats, "stats", 30, states=(ACTIVE,)))

    async def remove_sidecar(self, url: str) -> None:
        """Stops using a sidecar (its group membership ends at the next push); it keeps running."""
        for i in self.links.in_use():
            if self.links.url(i) == url:
                self.links.drop(i, "removed by the client")
                return
        raise ValueError(f"sidecar {url} is not in use")

    # -- weights (rollout.client.weight_sync_client) -------------------------------------------------
    async def init_weight_sync(self, host: str | None = None, port: int = 0, timeout_s: float = 120.0,
                               bucket_bytes: int | None = None, device=None, take_over: bool = False) -> dict:
        """Form one weight-sync group with every sidecar's workers; this trainer is rank 0.
        `host`: the address the sidecars reach this trainer at (default: 127.0.0.1 when every
        sidecar is on this machine, else this machine's address on the route to the first one).
        One trainer owns a sidecar's weight sync at a time: while another one's group is open and
        its trainer alive, this raises SidecarError (kind "refused") unless `take_over=True`.
        A joining sidecar (add_sidecar) that cannot join is dropped with a warning instead."""
        return await self.weight_sync.init_weight_sync(host, port, timeout_s, bucket_bytes, device, take_over)

    async def push_weights(self, model_or_named_tensors, version: int, pause_mode: str | None = None,
                           timeout_s: float = 300.0, progress=None, transport: str = "group", wait: bool = True,
                           mode: str = "adapter", delta: bool | None = None):
        """Pause every sidecar, broadcast the weights, commit, resume (weight_sync.trainer.push.run_push,
        delivered as a `push_weights` call to each sidecar). Raises SidecarError with the
        sidecars' reasons (and the trainer's) on any failure; the previous weights then keep
        serving. `progress(bucket, n_buckets)` is called (in a worker thread) as each bucket goes out.
        `transport="shared"`: sidecars on this machine read the weights from memory the trainer
        shares (weight_sync.trainer.shared_memory; `flatten_parameters(model, shared=True)` first): no group,
        no init_weight_sync; colocated on one GPU, this is the way (CUDA IPC).
        The group follows the sidecars: one added joins it here, one that went is left out of it;
        a sidecar that goes during the push costs one more try with the others.
        `wait=False`: returns a `PushHandle` as soon as the trainer's bytes are out (every engine
        holds every byte and the commit vote passed): the model is the trainer's to change again while
        the engines swap (in wait mode, after their requests end). A shared-memory push returns when
        the engines have read it (they read the trainer's own buffer).
        Awaiting the handle gives this call's result or raises its error; a push that fails after
        that point is not tried again (the bytes it sent are gone). The next push waits for it.
        A PEFT (LoRA) model goes as its adapter (`mode="adapter"`, a few MB; the base once to an
        engine that lacks it; weight_sync.common.lora) or as its merged weights (`mode="merged"`).
        `delta` (weight_sync/common/delta_push.py): None sends only the elements that changed since the
        last push when every sidecar holds that push and it is fewer bytes, the full weights
        otherwise (and every `delta_anchor_every` pushes, and after a sidecar joined, went, was
        healed or a push failed); True a delta whenever there is a base; False always the full
        weights, keeping no copy of them (a delta's base costs the trainer one copy of the weights
        in the wire dtype, on their device). The reply's "delta" says which went, and its trainer
        part the bytes on the wire ("bytes") beside the full size ("full_bytes")."""
        return await self.weight_sync.push_weights(model_or_named_tensors, version, pause_mode, timeout_s, progress,
                                               transport, wait, mode, delta)

    async def load_weights(self, path: str, version: int, pause_mode: str | None = None,
                           timeout_s: float = 300.0) -> list[dict]:
        """The file fallback: every sidecar's engines load the push that
        `weight_sync.trainer.file_push.write_safetensors(model, path, version)` wrote to `path` (a directory
        every sidecar can read, e.g. under /dev/shm on one host), all or nothing per engine."""
        return await self.weight_sync.load_weights(path, version, pause_mode, timeout_s)

    async def close_weight_sync(self) -> None:
        await self.weight_sync.close_weight_sync()

    def checksum_of(self, model_or_named_tensors) -> str:
        """The checksum every engine's `weights_checksums()` entry equals after pushing this
        model (in the push's dtype); for checking a push."""
        return self.weight_sync.checksum_of(model_or_named_tensors)

    async def weights_checksums(self) -> list[str]:
        """Every worker's weights checksum, active sidecars in order (compare with WeightSender.checksum)."""
        return await self.weight_sync.weights_checksums()

    # -- sharing a GPU ------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Every engine frees its KV cache (level 1) or its weights too (level 2), for a trainer
        that shares the GPU; rollouts in flight are resubmitted and wait for `wake_up()`. After
        level 2 the engines hold the checkpoint again (version 0): push before generating."""
        await self.links.call_all(P.Sleep, "sleep", level=int(level))

    async def wake_up(self) -> None:
        await self.links.call_all(P.WakeUp, "wake_up")

    # -- status -------------------------------------------------------------------------------
    async def stats(self) -> list[dict]:
        return await self.links.call_all(P.Stats, "stats", timeout=30)

    async def health(self) -> list[dict]:
        return await self.links.call_all(P.Health, "health", timeout=30)

    async def load(self) -> list[dict]:
        """Each sidecar's load now (protocol.LoadReply: prompts in flight, the engines' running and waiting
        sequences, KV use, prefix-cache counters), without running a forward as health does."""
        return await self.links.call_all(P.Load, "load", timeout=30)

    async def close(self) -> None:
        if self._load_watch is not None:
            self._load_watch.cancel()
            await asyncio.gather(self._load_watch, return_exceptions=True)
        await self.weight_sync.close()  # a push still swapping is let go: its sidecars finish on their own
        await self.links.close()
        self._release()
