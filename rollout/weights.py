"""The sidecar's side of weight sync: join the trainer's group, and run each push as
pause -> receive -> commit -> resume across every engine (weight_sync does the transfer)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from engine.errors import EngineUnhealthyError
from weight_sync.common.manifest import Manifest
from weight_sync.common.progress import FAILED_MARK, WITHDRAWN_MARK, PushProgress
from weight_sync.common.votes import WeightSyncError
from weight_sync.engine_side.engines import (
    close_weight_sync, commit_results, finish_on_engines, join_engines, load_on_engines, receive_on_engines,
    stage_on_engines, workers_of,
)

log = logging.getLogger(__name__)


class WeightSyncRefused(RuntimeError):
    """A weight-sync call the sidecar's state refuses (another trainer owns the group, a version
    that does not go up); nothing changed. Reported with error kind "refused"."""

    refused = True


class WeightSyncRegroup(WeightSyncRefused):
    """A push over a group that no longer holds the sidecar's engines (one was restarted since
    the group formed): nothing changed; the client forms a new group and pushes again."""

    regroup = True


class PushWithdrawn(WeightSyncRefused):
    """A push its trainer withdrew before any byte moved (weight_sync.trainer.push, step 6): the layout it
    reused no longer fits its weights, and it pushes them again at once on a fresh one. Nothing
    changed, and it is no failed push: the push that follows tells."""

    withdrawn = True


def trainer_reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether the trainer that owns the group still listens on its rendezvous port (rank 0 hosts
    the group's store there for the group's life): a dead trainer's port refuses at once."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def owned_message(group_name: str) -> str:
    return (f"another trainer owns this sidecar's weight sync (group {group_name}); it must close_weight_sync() "
            "first, or call init_weight_sync(take_over=True)")


class SidecarWeights:
    """One trainer owns the weight-sync group at a time: a second `init` is refused unless the
    first closed its group, its trainer is gone (its rendezvous port refuses), or the caller takes
    over. Versions only go up: a push or load of a version <= the sidecar's changes nothing
    (version 0 over version 0 excepted: a trainer's initial sync of the checkpoint)."""

    def __init__(self, manager, stall_s: float = 10.0, overlap: bool = True, staging_limit: int | None = None):
        self.manager = manager
        self.overlap = overlap  # receive a push while the engines generate; pause only for the swap
        self.staging_limit = staging_limit  # bytes of staging per engine (None: the device's free memory)
        self._room_for: tuple | None = None  # (layout bytes, engines) that had room for staging last time
        self.stall_s = stall_s  # a push's transfer with no bucket out for this long is given up
        self.owner: dict | None = None  # the group's host, port and name, while a trainer owns it
        self._info: dict = {}  # the owner's connection info, its secret included: never logged
        self.members: list[int] = []  # id() of each engine in that group, in rank order

    async def init(self, host: str, port: int, world_size: int, rank_offset: int, group_name: str,
                   timeout_s: float, secret: str, take_over: bool = False) -> dict:
        info = {"host": host, "port": port, "world_size": world_size, "group_name": group_name,
                "timeout_s": timeout_s, "secret": secret}
        engines = self.manager.up_engines()
        if self.owner is not None and self.owner["group_name"] != group_name:
            old = self.owner
            alive = (await self.owner_status())["alive"]
            if alive and not take_over:
                raise WeightSyncRefused(owned_message(old["group_name"]))
            log.warning("weight-sync group %s %s: leaving it for group %s", old["group_name"],
                        "taken over" if alive else "lost its trainer", group_name)
            self.owner = None
            await close_weight_sync(engines)
        await join_engines(engines, info, rank_offset, timeout=timeout_s + 30)
        self.owner = {"host": host, "port": port, "group_name": group_name}
        self._info = info
        self.members = [id(e) for e in engines]
        last = rank_offset + sum(workers_of(e) for e in engines) - 1
        log.info("joined weight-sync group %s as ranks %d..%d of %d", group_name, rank_offset, last, world_size)
        return {"ranks": list(range(rank_offset, last + 1))}

    async def push(self, manifest: Manifest, pause_mode: str | None, timeout_s: float, on_paused=None,
                   group_name: str | None = None, shared: dict | None = None) -> dict:
        """Over the group, or (`shared`: a weight_sync.trainer.shared_memory handle) from memory on this machine.
        (A malformed manifest never gets here: the call's decoding refuses it, rollout.protocol.)"""
        m = self.manager
        if not shared and group_name and (self.owner is None or self.owner["group_name"] != group_name):
            raise WeightSyncRefused(f"push over group {group_name}, which does not own this sidecar's weight sync "
                                    f"(now {self.owner and self.owner['group_name']}): another trainer took over")
        self._check_version(manifest.version)
        engines = m.up_engines()
        if not shared and [id(e) for e in engines] != self.members:
            raise WeightSyncRegroup(f"this sidecar's engines changed since group {group_name} formed (an engine was "
                                    "restarted): init_weight_sync again (RolloutClient does so by itself)")
        t0 = time.monotonic()
        inplace = not shared and manifest.adapter is None and not await self._staging_fits(engines, manifest)
        if self.overlap and not shared and not inplace:
            return await self._push_overlapped(engines, manifest, pause_mode, timeout_s, group_name, t0)

        async def receive() -> list:
            if inplace:
                m.state.count("inplace_pushes")
                results = await receive_on_engines(engines, manifest, timeout_s, group_name, "receive_weights_inplace")
                self._restart_torn(engines, results)
                return results
            if not shared:
                return await receive_on_engines(engines, manifest, timeout_s, group_name)
            calls = [e.collective_rpc("receive_weights_shared", timeout=timeout_s, args=(manifest.to_wire(), shared))
                     for e in engines]
            return await asyncio.gather(*calls, return_exceptions=True)

        async def work():
            t1 = time.monotonic()
            watchdog = None if shared or self.owner is None else asyncio.ensure_future(
                self._stop_stuck_engines(engines, manifest.push_id))
            try:
                results = await receive()
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            transfer = time.monotonic() - t1
            return {**await self._commit(engines, results, manifest), "transfer_seconds": transfer}

        return self._pushed(await m.run_paused(pause_mode, work, on_paused), t0)

    async def _commit(self, engines: list, results: list, manifest: Manifest) -> dict:
        """The engines' results of a push (weight_sync.engine_side.engines.commit_results); the sidecar
        serves its version once every engine committed it, and counts a failed push otherwise
        (unless its trainer withdrew it: PushWithdrawn)."""
        m = self.manager
        try:
            out = await commit_results(engines, results, manifest.version, "push")
        except Exception as e:
            if await self._withdrawn(manifest, e):
                raise PushWithdrawn(f"push of version {manifest.version} withdrawn by its trainer before any byte "
                                    "moved: the layout it reused no longer fits its weights, it pushes them again "
                                    "on a fresh one") from e
            m.state.count("failed_pushes")
            raise
        m.committed(manifest.version)
        return out

    async def _withdrawn(self, manifest: Manifest, error: Exception) -> bool:
        """Whether a push refused before any byte moved was refused by its trainer's vote on the
        layout it reused (it marks that, WITHDRAWN_MARK, before voting; the workers only hear
        "refused by another rank")."""
        if not getattr(error, "refused", False) or self.owner is None:
            return False
        try:
            return await asyncio.to_thread(PushProgress(self._info, manifest.push_id).read) == WITHDRAWN_MARK
        except Exception:  # noqa: BLE001 - the trainer's store did not answer: a failed push, as before
            return False

    def _pushed(self, out: dict, t0: float) -> dict:
        """A committed push's counters and reply (`out` holds its transfer_seconds)."""
        m = self.manager
        m.state.count("pushes")
        m.state.count("transfer_seconds", out["transfer_seconds"])
        m.state.count("push_seconds", time.monotonic() - t0)
        workers = out.pop("worker_results", None) or []
        applied = [w["apply_seconds"] for w in workers if isinstance(w, dict) and "apply_seconds" in w]
        if applied:  # a delta push: its slowest worker's apply (weight_sync/common/delta_push.py)
            out["apply_seconds"] = max(applied)
        return {**out, "seconds": time.monotonic() - t0}

    async def _push_overlapped(self, engines: list, manifest: Manifest, pause_mode: str | None, timeout_s: float,
                               group_name: str | None, t0: float) -> dict:
        """The bytes arrive while the engines keep generating (weight_sync.engine_side.engines.stage_on_engines);
        the engines pause, per `pause_mode`, only for the swap, the prefix-cache reset and the
        version tag. A push that fails before the swap leaves them serving the old weights, never
        paused; one whose trainer is lost is given up without stopping them (their receiving
        thread ends with the group's timeout)."""
        m = self.manager
        staging = asyncio.ensure_future(stage_on_engines(engines, manifest, timeout_s, group_name))
        watchdog = asyncio.ensure_future(self._trainer_lost(manifest.push_id)) if self.owner is not None else None
        with m.state.receiving():
            await asyncio.wait({staging} | ({watchdog} if watchdog else set()), return_when=asyncio.FIRST_COMPLETED)
        if not staging.done():  # the trainer is gone, failed or stalled: nothing to wait for
            staging.cancel()
            # leaving the group gives the push up on every worker: its staging memory goes now
            await asyncio.gather(*(e.collective_rpc("close_weight_sync", timeout=5, args=(False,)) for e in engines),
                                 return_exceptions=True)
            m.state.count("failed_pushes")  # once wound down: a caller who sees it may push again
            raise WeightSyncError(f"push of version {manifest.version} failed: {watchdog.result()}; nothing was "
                                  "committed and the engines never paused. init_weight_sync again")
        if watchdog is not None:
            watchdog.cancel()
        staged = staging.result()
        transfer = time.monotonic() - t0
        if any(r != "staged" for r in staged):  # every engine raises its reason; none commits
            results = await finish_on_engines(engines, staged, commit=False, timeout=timeout_s)
            await self._commit(engines, [r if isinstance(r, BaseException) else
                                         RuntimeError("dropped: another engine failed") for r in results],
                               manifest)

        async def swap():
            t1 = time.monotonic()
            results = await finish_on_engines(engines, staged, commit=True, timeout=timeout_s)
            out = await self._commit(engines, results, manifest)
            return {**out, "swap_seconds": time.monotonic() - t1, "transfer_seconds": transfer}

        return self._pushed(await m.run_paused(pause_mode, swap), t0)

    async def _staging_fits(self, engines: list, manifest: Manifest) -> bool:
        """Whether every engine has room for the push's staging copy; if not, the push goes in
        place (weight_sync.engine_side.inplace_receive), paused for the transfer, and the log says why. A yes
        holds for later pushes of the same size to the same engines (their memory is laid out at
        start: weights, KV cache, then the staging buffer a push keeps), so it is asked once."""
        # a delta stages the weights it makes and, apart, what it carries (weight_sync/common/delta_push.py)
        need = manifest.layout_bytes if manifest.delta is None else manifest.delta.full_bytes + manifest.layout_bytes
        key = (need, tuple(id(e) for e in engines))
        if self._room_for == key:
            return True
        rooms = await asyncio.gather(*(e.collective_rpc("staging_room", timeout=30,
                                                        args=(need, self.staging_limit))
                                       for e in engines), return_exceptions=True)
        short = [(i, r[0]["why"] if not isinstance(r, BaseException) else str(r)) for i, r in enumerate(rooms)
                 if isinstance(r, BaseException) or not r[0]["fits"]]
        for i, why in short:
            log.warning("engine %d has no room for a staging copy (%s): push of version %d is received in place, "
                        "the engines paused for the transfer", i, why, manifest.version)
        self._room_for = None if short else key
        return not short

    @staticmethod
    def _restart_torn(engines: list, results: list) -> None:
        """Engines whose in-place receive failed after writing hold torn weights: stopped, so that
        the supervisor restarts them with the last committed weights."""
        for i, (e, r) in enumerate(zip(engines, results)):
            if isinstance(r, EngineUnhealthyError) and e.proc.poll() is None:
                log.error("engine %d: %s; restarting it", i, r)
                e.proc.kill()

    async def _trainer_lost(self, push_id: str, period_s: float = 0.5, misses: int = 2) -> str:
        """During a push over the group the workers wait in the trainer's transfer, where nothing
        reaches them until the group's timeout (minutes). Three ways it cannot finish, noticed here:
        - the trainer is gone: its rendezvous port refuses twice in a row;
        - the trainer gave the push up (its broadcast failed: a peer of the group died): it marked
          the push failed (WeightSyncGroup.mark_progress);
        - the trainer stalled (frozen, or its link): no bucket marked, or its store silent, for
          `stall_s` once the transfer began (the wait for every worker before it is the
          trainer's, bounded by its own timeout).
        Returns how it was lost; the caller stops the push (_stop_stuck_engines when the engines
        wait in the transfer)."""
        owner, progress = dict(self.owner), PushProgress(self._info, push_id, timeout_s=period_s)
        missed, last, since, reading = 0, None, time.monotonic(), None
        while True:
            await asyncio.sleep(period_s)
            alive = await asyncio.to_thread(trainer_reachable, owner["host"], owner["port"], period_s)
            missed = 0 if alive else missed + 1
            if missed >= misses:
                why = "is gone"
                break
            # a frozen trainer's store may never answer: one read at a time, given `period_s`
            if reading is None or reading.done():
                reading = asyncio.ensure_future(asyncio.to_thread(progress.read))
            await asyncio.wait({reading}, timeout=period_s)
            mark = "silent"  # a store that does not answer: no progress
            if reading.done() and reading.exception() is None:
                mark = reading.result()
            now = time.monotonic()
            if mark == FAILED_MARK:
                why = "gave the push up"
                break
            if mark is None or mark != last:
                last, since = mark, now
            elif now - since > self.stall_s:
                why = f"made no progress for {self.stall_s:.0f} s"
                break
        if reading is not None:  # a read still waiting on a store that went: its error is expected
            reading.add_done_callback(lambda t: t.cancelled() or t.exception())
        return f"the trainer of group {owner['group_name']} {why} mid-push"

    async def _stop_stuck_engines(self, engines: list, push_id: str) -> None:
        """The engines wait in a transfer that will not finish: stopped, and the supervisor restarts
        them with the last committed weights (host copy or sibling); nothing is committed."""
        why = await self._trainer_lost(push_id)
        log.error("%s: stopping the engines stuck in its transfer", why)
        for e in engines:
            if e.proc.poll() is None:
                e.proc.kill()

    async def owner_status(self) -> dict | None:
        """The group that owns weight sync and whether its trainer still listens (None: no owner)."""
        if self.owner is None:
            return None
        alive = await asyncio.to_thread(trainer_reachable, self.owner["host"], self.owner["port"])
        return {"group_name": self.owner["group_name"], "alive": alive}

    def _check_version(self, version: int) -> None:
        """Versions only go up. Version 0 names the checkpoint's weights: a trainer's initial
        sync may push it while the sidecar still serves version 0."""
        if version < self.manager.version or (version == self.manager.version and version != 0):
            raise WeightSyncRefused(f"version {version} does not go up: this sidecar serves version "
                                    f"{self.manager.version}; push a higher one")

    async def load(self, path: str, version: int, pause_mode: str | None) -> dict:
        m = self.manager
        self._check_version(version)

        async def work():
            out = await load_on_engines(m.up_engines(), path, version)
            m.committed(version)
            return out

        out = await m.run_paused(pause_mode, work)
        out.pop("worker_results", None)
        m.state.count("pushes")
        return out

    async def close(self) -> None:
        self.owner = None
        self.members = []
        await close_weight_sync(self.manager.up_engines())
