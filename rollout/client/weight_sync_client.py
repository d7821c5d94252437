"""`WeightSyncClient`: the trainer's half of a push, over the sidecars' links (`PushLinks`,
rollout/client/push_links.py), as `weight_sync.engine_side.receive.PushReceiver` is the engine's half over its
`WeightTarget`s. It owns the sender (weight_sync.WeightSender), the group's members, the arguments
the group was formed with, when the next full push is due (`DeltaAnchors`) and the push still
swapping (push_weights(wait=False)). `AsyncRolloutClient` gives it its links and hands it its calls.

A push over the group is tried at most `TRIES` times, each try three steps:

1. group: a new one when the last one closed, or the sidecars in use changed (one joined or went);
2. push: weight_sync.trainer.push.run_push, delivered as a `push_weights` call to each member;
3. what its outcome asks for (`Step`): done; regroup (a member's engines changed since the group
   formed: close it, try again); a member went (try again without it); committed on the rest (it
   went after the commit vote: every member left holds the push); or failed.

Then the push lands (`_landed`): its version is recorded and joining members serve, or
SidecarError says every reason and the previous weights keep serving.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from urllib.parse import urlsplit

from rollout.common import protocol as P
from rollout.common.protocol import owned_message
from rollout.client.delta_anchors import DeltaAnchors
from rollout.client.push_call import PushCall, PushHandle
from rollout.client.push_links import PushLinks
from rollout.client.shared_push import push_shared
from rollout.client.sidecar_link import ACTIVE, CATCHING_UP, DROPPED, JOINING, SidecarError, SidecarGoneError

log = logging.getLogger("rollout.client")

TRIES = 3  # a push over the group: the first, and twice more after a regroup or a member lost


class Step(enum.Enum):
    """What a try's outcome asks for next."""

    DONE = "done"  # every member committed; or the bytes went out early (wait=False): none to resend
    REGROUP = "regroup"  # a member's engines changed since the group formed: a new group, once more
    WITHOUT_THE_LOST = "without the lost"  # a member went (or a joining one failed): once more without it
    COMMITTED_ON_THE_REST = "committed on the rest"  # a member went after the commit vote; the rest hold it
    FAILED = "failed"


class WeightSyncClient:
    def __init__(self, links: PushLinks):
        self.links = links
        self.sender = None  # weight_sync.WeightSender once init_weight_sync ran
        self.members: tuple[int, ...] = ()  # the sidecars in the current group
        self.init_args: dict | None = None  # init_weight_sync's arguments, until close_weight_sync
        self.group_name = ""  # the last group this client opened
        self.pushed: int | None = None  # the newest version this client pushed
        self.anchors = DeltaAnchors()
        self._pending: asyncio.Task | None = None  # a push_weights(wait=False) still swapping

    # -- the group ------------------------------------------------------------------------------
    async def init_weight_sync(self, host: str | None = None, port: int = 0, timeout_s: float = 120.0,
                               bucket_bytes: int | None = None, device=None, take_over: bool = False) -> dict:
        """One group of this trainer (rank 0) and every willing sidecar's workers (the next ranks).
        A sidecar that goes while the group forms has the forming called off at once (every rank
        told: `_join`), and the group is formed again without it."""
        for attempt in range(TRIES):
            try:
                return await self._form(host, port, timeout_s, bucket_bytes, device, take_over)
            except SidecarError as e:
                if e.kind != "gone" or attempt == TRIES - 1:
                    raise
                log.warning("a sidecar went while the weight-sync group formed (%s): forming it without it", e)

    async def _form(self, host: str | None, port: int, timeout_s: float, bucket_bytes: int | None, device,
                    take_over: bool) -> dict:
        members, health = await self._willing(take_over, timeout_s)
        host = host or self._trainer_address()
        self.init_args = {"host": host, "port": port, "timeout_s": timeout_s, "bucket_bytes": bucket_bytes,
                          "device": device}  # a regroup forms the next group the same way
        if self.sender is None:
            self.sender = _new_sender(device, timeout_s, bucket_bytes, wire_dtype(health))
        self.anchors.reset()  # a new group: the next push sends the full weights
        workers = [h["workers"] for h in health]
        world = 1 + sum(workers)
        info = self.sender.open_group(world, host=host, port=port, timeout_s=timeout_s)
        self.group_name = info["group_name"]  # the sidecars leave this one (and only this one) at close_weight_sync
        offsets = list(itertools.accumulate([1] + workers[:-1]))
        await self._join(members, offsets, info, world, timeout_s, take_over)
        self.members = tuple(members)
        return {"world_size": world, "rank_offsets": offsets, **{k: v for k, v in info.items() if k != "secret"}}

    async def _willing(self, take_over: bool, timeout_s: float) -> tuple[list[int], list[dict]]:
        """The sidecars that will join this trainer's group, and their health. One whose weight sync
        another live trainer owns refuses (SidecarError "refused") unless `take_over`; a joining one
        that would refuse is dropped instead."""
        group = self.sender.group if self.sender is not None else None
        members, health = [], []
        for i, h in await self._settled_health(timeout_s):
            owner = h.get("weight_sync_owner")
            mine = group is not None and owner and owner["group_name"] == group.group_name
            if owner and owner["alive"] and not take_over and not mine:  # refused before opening a group
                why = owned_message(owner["group_name"])
                if self.links.state(i) == JOINING:
                    self.links.drop(i, f"could not join: {why}")
                    continue
                raise SidecarError(f"init_weight_sync refused by {self.links.url(i)}: {why}", "refused")
            members.append(i)
            health.append(h)
        return members, health

    async def _settled_health(self, timeout_s: float) -> list[tuple[int, dict]]:
        """Each sidecar's health once none has an engine restarting or a push winding down (a
        group formed before would leave that engine out), waiting at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = await self.links.ask_all(P.Health, "health", 30, (ACTIVE, JOINING))
            busy = [self.links.url(i) for i, h in health
                    if h.get("pushing") or any(s["state"] == "restarting" for s in h.get("engine_states", ()))]
            if not busy or time.monotonic() > deadline:
                return health
            log.info("waiting for the engines of %s to settle before forming a weight-sync group", ", ".join(busy))
            await asyncio.sleep(0.2)

    async def _join(self, members: list[int], offsets: list[int], info: dict, world: int, timeout_s: float,
                    take_over: bool) -> None:
        """Every member's workers join the group opened as `info`, and the trainer with them; any
        failure closes it (SidecarError, kind "gone" when a member went: the others' joins fail with it)."""
        calls = [asyncio.ensure_future(self.links.call(
            i, P.InitWeightSync, "init_weight_sync", timeout_s + 60, host=info["host"], port=info["port"],
            world_size=world, rank_offset=offset, group_name=info["group_name"], timeout_s=timeout_s,
            secret=info["secret"], take_over=take_over)) for i, offset in zip(members, offsets)]
        await asyncio.sleep(0)  # the calls leave; one to a sidecar gone already has failed by now
        gone = [c.exception() for c in calls if c.done() and c.exception() is not None]
        if gone:  # no group can form: the trainer does not wait out its timeout for the workers
            for c in calls:
                c.cancel()
            self.sender.close_group()
            raise gone[0]
        for c in calls:
            c.add_done_callback(self._call_off_if_failed)
        joined = asyncio.ensure_future(asyncio.to_thread(self.sender.join_group))
        replies = await asyncio.gather(*calls, return_exceptions=True)
        trainer = (await asyncio.gather(joined, return_exceptions=True))[0]
        errors = [r for r in replies if isinstance(r, BaseException)]
        if not errors and isinstance(trainer, BaseException):  # the members' reasons say more than the trainer's
            errors = [trainer]
        if errors:
            self.sender.close_group()
            gone = any(isinstance(e, SidecarGoneError) for e in errors)  # the others' failures follow from it
            raise SidecarError("init_weight_sync failed: " + "; ".join(map(str, errors)), "gone" if gone else "")

    def _call_off_if_failed(self, call: asyncio.Future) -> None:
        """A member whose join failed will never join: every other rank (the trainer's too) is told
        now, not at the group's timeout."""
        if not call.cancelled() and call.exception() is not None and self.sender is not None:
            self.sender.call_off_group()

    def _trainer_address(self) -> str:
        """Where the sidecars reach this trainer: loopback when they are all on this machine."""
        from weight_sync.common.hosts import is_loopback, local_address_towards

        hosts = [urlsplit(self.links.url(i)).hostname for i in self.links.members(ACTIVE, CATCHING_UP, JOINING)]
        away = [h for h in hosts if h and not is_loopback(h)]
        return local_address_towards(away[0]) if away else "127.0.0.1"

    async def close_weight_sync(self) -> None:
        await self.settle_pending_push()
        if self.group_name:  # a client that never opened a group has none to leave (another trainer's stays)
            await self.links.ask_all(P.CloseWeightSync, "close_weight_sync", None, (ACTIVE, JOINING),
                                     group_name=self.group_name)
        self.init_args = None
        self.members = ()
        if self.sender is not None:
            self.sender.close_group()

    async def close(self) -> None:
        """Lets a push still swapping go (its sidecars finish their swap on their own) and closes the group."""
        if self._pending is not None:
            self._pending.cancel()
            await asyncio.gather(self._pending, return_exceptions=True)
            self._pending = None
        if self.sender is not None:
            self.sender.close_group()
            self.sender = None

    # -- a push ---------------------------------------------------------------------------------
    async def push_weights(self, weights, version: int, pause_mode: str | None = None, timeout_s: float = 300.0,
                           progress=None, transport: str = "group", wait: bool = True, mode: str = "adapter",
                           delta: bool | None = None):
        """A push (AsyncRolloutClient.push_weights says what each argument does): its reply, or with
        `wait=False` a `PushHandle` once the trainer's bytes are out."""
        await self.settle_pending_push()
        sent = None if wait else asyncio.get_running_loop().create_future()
        pushing = self._push(weights, transport, PushCall(version, pause_mode, timeout_s, progress, mode, delta, sent))
        if wait:
            return await pushing
        task = asyncio.ensure_future(pushing)
        await asyncio.wait({sent, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() and task.exception() is not None:
            raise task.exception()
        self._pending = task
        return PushHandle(task, version)

    async def settle_pending_push(self) -> None:
        """A push that returned early (wait=False) ends before the next push or group change."""
        task, self._pending = self._pending, None
        if task is not None:
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                log.warning("the previous push (wait=False) failed: %s", outcome)  # its handle raises it too

    async def _push(self, weights, transport: str, push: PushCall) -> dict:
        from weight_sync.trainer.lora_push import is_peft_model

        if transport == "shared":
            if is_peft_model(weights):
                raise ValueError("transport='shared' pushes from the trainer's own flattened buffer, which a PEFT "
                                 "model's adapter or merged weights are not in: push it over the group (the default)")
            return await self._push_shared(weights, push)
        if transport != "group":
            raise ValueError(f"transport must be 'group' or 'shared', got {transport!r}")
        if self.sender is None or (self.sender.group is None and self.init_args is None):
            raise SidecarError("init_weight_sync() first")
        return await self._push_over_group(weights, push)

    async def _push_over_group(self, weights, push: PushCall) -> dict:
        """Steps 1-3 of the module doc, up to TRIES times, then the push lands."""
        from weight_sync.trainer.ranks import PeersFollowing

        with PeersFollowing() as peers:  # a trainer's other ranks follow every try, then are told DONE once
            for _ in range(TRIES):
                await self._group_of_the_sidecars_in_use()
                outcome = await self._try(weights, push, peers)
                step = self._next_step(outcome, push)
                if step is Step.REGROUP:
                    self.sender.close_group()  # the next try forms a new one
                elif step is not Step.WITHOUT_THE_LOST:
                    break
        return self._landed(outcome, push.version)

    async def _group_of_the_sidecars_in_use(self) -> None:
        """Step 1: a new group when the last one failed and closed, or a sidecar joined or went since."""
        if self.sender.group is None or self.members != tuple(self.links.members(ACTIVE, JOINING)):
            await self.init_weight_sync(**self.init_args, take_over=True)

    async def _try(self, weights, push: PushCall, peers):
        """Step 2: one run_push over the group, delivered as a `push_weights` call to each member."""
        from weight_sync.trainer.push import run_push

        def deliver(manifest) -> list:
            group_name = self.sender.group.group_name
            return [(self.links.url(i), self.links.call(i, P.PushWeights, "push_weights", push.timeout_s + 60,
                                                        manifest=manifest, pause_mode=push.pause_mode or "",
                                                        timeout_s=push.timeout_s, group_name=group_name))
                    for i in self.members]

        delta = push.delta if push.delta is not None else self.anchors.auto()
        t0 = time.monotonic()
        outcome = await run_push(self.sender, weights, push.version, deliver, push.timeout_s + 60, push.progress,
                                 push.on_sent, push.mode, peers, delta, self.anchors.due())
        self.anchors.count(outcome.trainer, time.monotonic() - t0)
        return outcome

    def _next_step(self, outcome, push: PushCall) -> Step:
        """Step 3: what the outcome asks for. A joining member that failed the push is dropped here."""
        if not outcome.errors or push.bytes_out_early():
            return Step.DONE
        if outcome.regroup:
            log.warning("a sidecar's engines changed since the weight-sync group formed: forming a new group")
            return Step.REGROUP
        if not self._leave_out_the_lost(outcome):
            return Step.FAILED
        if self._committed_on_the_rest(outcome):
            return Step.COMMITTED_ON_THE_REST
        log.warning("push failed (%s): once more without the sidecars that went", " | ".join(outcome.errors))
        return Step.WITHOUT_THE_LOST

    def _leave_out_the_lost(self, outcome) -> bool:
        """True when some member is out of the next try: it went during the push, or it was still
        joining and failed it (dropped here, with a warning)."""
        lost = False
        for i, result in zip(self.members, outcome.results):
            if self.links.state(i) == JOINING and isinstance(result, BaseException):
                self.links.drop(i, f"could not join: {result}")
            lost = lost or self.links.state(i) == DROPPED
        return lost

    def _committed_on_the_rest(self, outcome) -> bool:
        """Every member of the push still in use committed it (the ones that failed it went):
        pushing again would only be refused by them ("version does not go up")."""
        left = [r for i, r in zip(self.members, outcome.results) if self.links.state(i) != DROPPED]
        return bool(left) and not isinstance(outcome.trainer, BaseException) and \
            not any(isinstance(r, BaseException) for r in left)

    def _landed(self, outcome, version: int) -> dict:
        """The push's reply once the tries are over; SidecarError unless every member still in use committed it."""
        members, results = self.members, outcome.results
        if outcome.errors:
            if not self._committed_on_the_rest(outcome):
                raise SidecarError(f"push of version {version} failed: " + " | ".join(outcome.errors),
                                   "refused" if outcome.refused else "")
            members, results = zip(*[(i, r) for i, r in zip(members, results) if self.links.state(i) != DROPPED])
            log.warning("push of version %d committed on every sidecar left (%s went during it)", version,
                        self.links.gone_reasons())
        self._record(members, version)
        return {"version": version, "delta": bool(outcome.trainer.get("delta")), "trainer": outcome.trainer,
                "sidecars": list(results)}

    def _record(self, members, version: int) -> None:
        """`version` committed on `members`: joining ones serve; an active one that missed it waits for the
        next push, which goes in full."""
        self.pushed = version
        if self.links.pushed(members, version):
            self.anchors.reset()

    async def _push_shared(self, weights, push: PushCall) -> dict:
        from weight_sync.trainer.sender import WeightSender

        if self.sender is None:
            self.sender = WeightSender(timeout_s=push.timeout_s)
        self.anchors.reset()  # weights that did not go over the group: the next push there is full
        members, replies = await push_shared(self.sender, self.links, weights, push)
        self._record(members, push.version)
        return {"version": push.version, "sidecars": replies}

    # -- other ways in, and checks ----------------------------------------------------------------
    async def load_weights(self, path: str, version: int, pause_mode: str | None, timeout_s: float) -> list[dict]:
        self.anchors.reset()  # weights that did not go over the group: the next push there is full
        answers = await self.links.ask_all(P.LoadWeights, "load_weights", timeout_s, (ACTIVE, JOINING),
                                           path=str(path), version=int(version), pause_mode=pause_mode or "")
        self._record([i for i, _ in answers], version)
        return [a for _, a in answers]

    def checksum_of(self, weights) -> str:
        if self.sender is None:
            raise SidecarError("init_weight_sync() first")
        return self.sender.checksum(weights)

    async def weights_checksums(self) -> list[str]:
        return [c for _, per in await self.links.ask_all(P.Checksum, "checksum", 120, (ACTIVE,)) for c in per]


def _new_sender(device, timeout_s: float, bucket_bytes: int | None, dtype):
    from weight_sync.trainer.sender import WeightSender

    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return WeightSender(device=device, timeout_s=timeout_s, dtype=dtype, **kw)


def wire_dtype(health: list[dict]):
    """The dtype a push travels in: the engines' own, when they all hold one (an fp32 trainer
    sends a bf16 engine bf16, half the bytes and no cast at commit); None (each tensor's own)
    when they differ or do not say."""
    import torch

    names = {h.get("dtype") for h in health}
    name = names.pop() if len(names) == 1 else None
    return getattr(torch, name) if name in ("float32", "bfloat16", "float16") else None
