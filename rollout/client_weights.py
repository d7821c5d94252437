"""The weight-sync half of `AsyncRolloutClient` (rollout/client.py), a mixin on the client's
sidecar links and calls: forming the group with every sidecar's workers, pushes (over the group,
from shared memory, or from files) and their checks, and an added sidecar caught up from a peer.
The group follows the sidecars: one added joins at the next push, one that went is left out of it."""

from __future__ import annotations

import asyncio
import itertools
import logging
from urllib.parse import urlsplit
from typing import TYPE_CHECKING

from rollout import protocol as P
from rollout.sidecar_link import ACTIVE, CATCHING_UP, DROPPED, JOINING, SidecarError

if TYPE_CHECKING:
    from weight_sync.common.manifest import Manifest

log = logging.getLogger("rollout.client")

# A full push every this many (verl and Fireworks send a full "anchor" every 20-30 deltas): a delta
# is exact by construction (every push's digest is checked), the anchor bounds what a bug could cost.
DELTA_ANCHOR_EVERY = 20


class WeightSyncCalls:
    async def init_weight_sync(self, host: str | None = None, port: int = 0, timeout_s: float = 120.0,
                               bucket_bytes: int | None = None, device=None, take_over: bool = False) -> dict:
        """Form one weight-sync group with every sidecar's workers; this trainer is rank 0.
        `host`: the address the sidecars reach this trainer at (default: 127.0.0.1 when every
        sidecar is on this machine, else this machine's address on the route to the first one).
        One trainer owns a sidecar's weight sync at a time: while another one's group is open and
        its trainer alive, this raises SidecarError (kind "refused") unless `take_over=True`.
        A joining sidecar (add_sidecar) that cannot join is dropped with a warning instead."""
        from rollout.weights import owned_message
        from weight_sync.trainer.sender import WeightSender

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
        host = host or self._trainer_address()
        self._init_args = {"host": host, "port": port, "timeout_s": timeout_s, "bucket_bytes": bucket_bytes,
                           "device": device}  # a regroup forms the next group the same way
        workers = [h["workers"] for h in health]
        world = 1 + sum(workers)
        if self.sender is None:
            kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
            self.sender = WeightSender(device=device, timeout_s=timeout_s, dtype=wire_dtype(health), **kw)
        self._since_anchor = None  # a new group: the next push sends the full weights
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

    def _trainer_address(self) -> str:
        """Where the sidecars reach this trainer: loopback when they are all on this machine."""
        from weight_sync.common.hosts import is_loopback, local_address_towards

        hosts = [urlsplit(link.url).hostname for link in self._links if link.state != DROPPED]
        away = [h for h in hosts if h and not is_loopback(h)]
        return local_address_towards(away[0]) if away else "127.0.0.1"

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
        await self._settle_pending_push()
        if wait:
            return await self._push(model_or_named_tensors, version, pause_mode, timeout_s, progress, transport,
                                    mode, delta=delta)
        sent = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._push(model_or_named_tensors, version, pause_mode, timeout_s, progress,
                                                transport, mode, sent, delta))
        await asyncio.wait({sent, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() and task.exception() is not None:
            raise task.exception()
        self._pending_push = task
        return PushHandle(task, version)

    async def _settle_pending_push(self) -> None:
        """A push that returned early (wait=False) ends before the next push or group change."""
        task, self._pending_push = getattr(self, "_pending_push", None), None
        if task is not None:
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                log.warning("the previous push (wait=False) failed: %s", outcome)  # its handle raises it too

    async def _push(self, weights, version: int, pause_mode: str | None, timeout_s: float, progress,
                    transport: str, mode: str, sent: asyncio.Future | None = None, delta: bool | None = None) -> dict:
        from weight_sync.trainer.lora_push import is_peft_model
        from weight_sync.trainer.push import run_push
        from weight_sync.trainer.ranks import PeersFollowing

        def on_sent(_result) -> None:
            if sent is not None and not sent.done():
                sent.set_result(True)

        if transport == "shared":
            if is_peft_model(weights):
                raise ValueError("transport='shared' pushes from the trainer's own flattened buffer, which a PEFT "
                                 "model's adapter or merged weights are not in: push it over the group (the default)")
            return await self._push_shared(weights, version, pause_mode, timeout_s, on_sent)
        if transport != "group":
            raise ValueError(f"transport must be 'group' or 'shared', got {transport!r}")
        if self.sender is None or (self.sender.group is None and self._init_args is None):
            raise SidecarError("init_weight_sync() first")

        def deliver(manifest) -> list:
            group_name = self.sender.group.group_name
            return [(self._links[i].url, self._push_call(i, manifest, pause_mode, timeout_s, group_name))
                    for i in self._members]

        with PeersFollowing() as peers:  # a trainer's other ranks follow every attempt, then are told DONE once
            for attempt in range(3):
                if self.sender.group is None or self._members != tuple(self._in(ACTIVE, JOINING)):
                    # a new group: the last one failed and closed, or a sidecar joined or went since
                    await self.init_weight_sync(**self._init_args, take_over=True)
                anchor = self._since_anchor is None or self._since_anchor + 1 >= self.delta_anchor_every
                outcome = await run_push(self.sender, weights, version, deliver, timeout_s + 60, progress,
                                         on_sent if sent is not None else None, mode, peers, delta, anchor)
                self._count_anchor(outcome.trainer)
                if not outcome.errors or (sent is not None and sent.done()):
                    break  # done; or failed after the trainer's bytes went out early (wait=False): none to resend
                if outcome.regroup:  # a sidecar's engines changed (one was restarted): a new group, and once more
                    log.warning("a sidecar's engines changed since the weight-sync group formed: forming a new group")
                    self.sender.close_group()
                    continue
                if not self._leave_out_failed_sidecars(outcome):
                    break
                if self._committed_on_the_rest(outcome):  # one went after the commit vote: the others hold it
                    break
        members, results = self._members, outcome.results
        if outcome.errors:
            if not self._committed_on_the_rest(outcome):
                raise SidecarError(f"push of version {version} failed: " + " | ".join(outcome.errors),
                                   "refused" if outcome.refused else "")
            members, results = zip(*[(i, r) for i, r in zip(members, results) if self._links[i].state != DROPPED])
            log.warning("push of version %d committed on every sidecar left (%s went during it)", version,
                        self._gone_reasons())
        self._pushed_to(members, version)
        return {"version": version, "delta": bool(outcome.trainer.get("delta")), "trainer": outcome.trainer,
                "sidecars": list(results)}

    def _count_anchor(self, trainer) -> None:
        """Deltas since the last full push; a failed push makes the next one full."""
        if isinstance(trainer, BaseException):
            self._since_anchor = None
        elif trainer.get("delta"):
            self._since_anchor = (self._since_anchor or 0) + 1
        else:
            self._since_anchor = 0

    def _committed_on_the_rest(self, outcome) -> bool:
        """Every sidecar of the push that is still in use committed it (the ones that failed it
        went): pushing again would only be refused by them ("version does not go up")."""
        left = [r for i, r in zip(self._members, outcome.results) if self._links[i].state != DROPPED]
        return bool(left) and not isinstance(outcome.trainer, BaseException) and \
            not any(isinstance(r, BaseException) for r in left)

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
        """A push committed on `members`: joining ones now hold the newest weights and serve; an
        active one that was not among them (caught up from a peer during the push) waits for the next."""
        self._pushed = version
        for i in members:
            if self._links[i].state == JOINING:
                self._links[i].state = ACTIVE
                log.info("sidecar %s holds version %d and serves", self._links[i].url, version)
        for i in self._in(ACTIVE):
            if i not in members:
                self._links[i].state = JOINING
                self._since_anchor = None  # it missed this push: the next goes in full
                log.info("sidecar %s missed version %d: it serves again after the next push", self._links[i].url,
                         version)

    async def _catch_up(self, i: int, asked: asyncio.Event, rounds: int = 4) -> None:
        """Sidecar i (catching up) is sent the newest committed weights by a live sidecar
        (P.SendWeights); it serves once it holds the version this client wants (the one it pushed
        last, else its sidecars' newest). Each round first asks the newcomer itself: a push into
        it (another client's catch-up) is waited out, and weights it already holds are enough. A
        push that lands meanwhile means one more round; a peer that fails, another peer; none
        left, or rounds spent: it joins at the next push."""
        link = self._links[i]
        failed: set[int] = set()
        try:
            for sent in range(rounds + 1):  # the last round only checks what the one before sent
                version = await self._settled_version(i)
                if link.state != CATCHING_UP:
                    return
                if version == await self._newest_version():
                    link.state = ACTIVE
                    log.info("sidecar %s holds version %d and serves", link.url, version)
                    return
                peers = [j for j in self._in(ACTIVE) if j not in failed]
                if not peers or sent == rounds:
                    break
                j = peers[0]
                try:
                    call_id, q = await self._send(j, P.SendWeights, to=link.url, timeout_s=self.timeout_s)
                    asked.set()
                    out = await self._reply(j, call_id, q, "send_weights", self.timeout_s + 60)
                    log.info("%s sent sidecar %s version %d (%s, %.1f s)", self._links[j].url, link.url,
                             out["version"], out["from"], out["seconds"])
                except (SidecarError, TimeoutError) as e:
                    if link.state == DROPPED:
                        return
                    log.warning("catching %s up from %s failed: %s", link.url, self._links[j].url, e)
                    failed.add(j)
        except (SidecarError, TimeoutError) as e:  # the newcomer itself failed or went
            log.warning("sidecar %s could not be caught up: %s", link.url, e)
        finally:
            asked.set()
        if link.state == CATCHING_UP:
            link.state = JOINING
            log.warning("sidecar %s was not caught up from a peer: it serves after the next push", link.url)

    async def _settled_version(self, i: int, timeout_s: float = 600.0) -> int:
        """Sidecar i's version once no push is under way into it."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            call_id, q = await self._send(i, P.Health)
            h = await self._reply(i, call_id, q, "health", 30)
            if not h["pushing"] or asyncio.get_running_loop().time() > deadline:
                return h["version"]
            await asyncio.sleep(0.5)

    async def _push_shared(self, weights, version: int, pause_mode: str | None, timeout_s: float, on_sent) -> dict:
        from weight_sync.trainer.ranks import DONE, tell_peers
        from weight_sync.trainer.sender import WeightSender
        from weight_sync.trainer.shared_memory import export_weights
        from weight_sync.trainer.weights import named_weights

        if self.sender is None:
            self.sender = WeightSender(timeout_s=timeout_s)
        try:
            prepared = self.sender.prepare(weights, version)
            with named_weights(prepared.weights) as named:
                shared = export_weights(prepared.manifest, named)
        finally:
            tell_peers(DONE)  # nothing to gather from shared memory: a trainer's other ranks stop following
        members = self._in(ACTIVE, JOINING)
        sent = [(i, *await self._send(i, P.PushWeights, manifest=prepared.manifest, pause_mode=pause_mode or "",
                                      timeout_s=timeout_s, shared=shared)) for i in members]
        replies = await asyncio.gather(*(self._reply(i, cid, q, "push_weights", timeout_s + 60) for i, cid, q in sent),
                                       return_exceptions=True)
        on_sent(None)  # only now: the engines read the trainer's own buffer, which its next step changes
        self._since_anchor = None  # weights that did not go over the group: the next push there is full
        errors = [str(r) for r in replies if isinstance(r, BaseException)]
        if errors:
            raise SidecarError(f"push of version {version} failed: " + " | ".join(errors))
        self._pushed_to(members, version)
        return {"version": version, "sidecars": replies}

    async def _push_call(self, i: int, manifest: Manifest, pause_mode: str | None, timeout_s: float,
                         group_name: str) -> dict:
        """Sidecar i pauses its engines, which receive the push in the trainer's group."""
        call_id, q = await self._send(i, P.PushWeights, manifest=manifest, pause_mode=pause_mode or "",
                                      timeout_s=timeout_s, group_name=group_name)
        return await self._reply(i, call_id, q, "push_weights", timeout_s + 60)

    async def load_weights(self, path: str, version: int, pause_mode: str | None = None,
                           timeout_s: float = 300.0) -> list[dict]:
        """The file fallback: every sidecar's engines load the push that
        `weight_sync.trainer.file_push.write_safetensors(model, path, version)` wrote to `path` (a directory
        every sidecar can read, e.g. under /dev/shm on one host), all or nothing per engine."""
        members = self._in(ACTIVE, JOINING)
        self._since_anchor = None  # weights that did not go over the group: the next push there is full
        out = await self._call_all(P.LoadWeights, "load_weights", timeout_s, path=str(path), version=int(version),
                                   pause_mode=pause_mode or "")
        self._pushed_to([i for i in members if self._links[i].state != DROPPED], version)
        return out

    async def close_weight_sync(self) -> None:
        await self._settle_pending_push()
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


class PushHandle:
    """A push that `push_weights(wait=False)` returned early: the trainer's bytes are out and the
    engines are swapping. `await handle` gives push_weights' result or raises its SidecarError."""

    def __init__(self, task: asyncio.Task, version: int):
        self.task, self.version = task, version

    def done(self) -> bool:
        return self.task.done()

    def __await__(self):
        return self.task.__await__()

    def __repr__(self) -> str:
        return f"PushHandle(version={self.version}, {'done' if self.done() else 'swapping'})"


def wire_dtype(health: list[dict]):
    """The dtype a push travels in: the engines' own, when they all hold one (an fp32 trainer
    sends a bf16 engine bf16, half the bytes and no cast at commit); None (each tensor's own)
    when they differ or do not say."""
    import torch

    names = {h.get("dtype") for h in health}
    name = names.pop() if len(names) == 1 else None
    return getattr(torch, name) if name in ("float32", "bfloat16", "float16") else None
