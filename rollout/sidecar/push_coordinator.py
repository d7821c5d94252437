"""One staged push on the sidecar, whatever front end carries it (the ZMQ protocol: rollout/sidecar/weights.py;
vLLM's RL routes: rollout/sidecar/vllm_transfer.py; SGLang's: rollout/sidecar/sglang_transfer.py). It holds who owns the
sidecar's weight sync, watches that trainer while its bytes arrive, and runs a push's steps in order:

1. stage: the bytes arrive in staging while the engines generate; a trainer lost meanwhile gives the
   push up on every engine, which never paused;
2. pause the engines (the push's mode, or the trainer paused them itself), only for the swap;
3. finish: every engine swaps its staged weights in, or none does;
4. commit: prefix cache reset, version tag, the sidecar serves the version;
5. count: the push's counters and reply.

A push the engines cannot take while they generate (received in place, from shared memory, or with
--overlap-receive off) runs pause -> receive -> commit -> count instead (`push_paused`). Front ends
pass in what differs (how their trainer's group is joined and left, how the bytes arrive) and turn
refusals into their own answers; only the coordinator changes its state. The engines are reached
through `SidecarEngines` (the RolloutManager), the counters through the sidecar's `SidecarState`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine import EngineClient
from engine.errors import EngineUnhealthyError, RefusedError, error_kind
from rollout.common.protocol import owned_message
from rollout.sidecar.push_watch import Owner, trainer_lost
from rollout.sidecar.state import SidecarState
from weight_sync.common.manifest import Manifest
from weight_sync.common.progress import WITHDRAWN_MARK, PushProgress
from weight_sync.common.votes import WeightSyncError
from weight_sync.engine_side.engines import commit_results, finish_on_engines, load_on_engines, stage_on_engines

log = logging.getLogger(__name__)
FINISH = "finish_staged_weights"  # the engines' commit of a staged push (commit_held_parts: of one in parts)


class WeightSyncRefused(RefusedError):
    """A weight-sync call the sidecar's state refuses (another trainer owns the group, a version
    that does not go up); nothing changed. Reported with error kind "refused"."""


class OwnedElsewhere(WeightSyncRefused):
    """Another trainer owns the sidecar's weight sync and still lives (`owner`: that one)."""

    def __init__(self, owner: Owner):
        super().__init__(owned_message(owner.group_name))
        self.owner = owner


class WeightSyncRegroup(WeightSyncRefused):
    """A push over a group that no longer holds the sidecar's engines (one was restarted since
    the group formed): nothing changed; the client forms a new group and pushes again."""

    error_kind = "regroup"


class PushWithdrawn(WeightSyncRefused):
    """A push its trainer withdrew before any byte moved (weight_sync.trainer.push, step 6): the layout it
    reused no longer fits its weights, and it pushes them again at once on a fresh one. Nothing
    changed, and it is no failed push: the push that follows tells."""

    withdrawn = True


class TrainerLost(WeightSyncError):
    """A push given up because its trainer is gone, gave it up or stalled: nothing was committed."""


class SidecarEngines(Protocol):
    """What a push uses of the engines it lands on (rollout.sidecar.manager.RolloutManager is one)."""

    def up_engines(self) -> list[EngineClient]:
        """The engines a push reaches: live ones, and restarted ones waiting for a push."""

    async def run_paused(self, mode: str | None, work: Callable[[], Awaitable[Any]],
                         on_paused: Callable[[], Awaitable[None]] | None = None) -> Any:
        """Pauses every engine (`mode`, None: the sidecar's), awaits on_paused() and work(), resumes them."""

    def committed(self, version: int) -> None:
        """Every engine that is up committed `version`: it is served from now on."""

    def stop_engines(self, engines: Sequence[EngineClient], why: str) -> None:
        """Stops these engines' processes; their supervisor restarts them with the last committed weights."""

    def serving(self) -> dict:
        """What the engines serve from (precision, the 8-bit copy's memory): said in each push's reply."""


@dataclass
class Staged:
    """A push whose bytes every engine holds in staging, waiting for its finish."""

    manifest: Manifest
    engines: list[EngineClient]
    results: list  # each engine's "staged"
    timeout_s: float
    started: float  # time.monotonic() at the push's start
    transfer_seconds: float


class PushCoordinator:
    """One trainer owns the weight-sync group at a time: another one's `take` is refused unless the
    first closed its group, its trainer is gone (its rendezvous port refuses), or the caller takes
    over. Versions only go up: a push or load of a version <= the sidecar's changes nothing
    (version 0 over version 0 excepted: a trainer's initial sync of the checkpoint)."""

    def __init__(self, sidecar: SidecarEngines, state: SidecarState, stall_s: float = 10.0):
        self.sidecar = sidecar
        self.state = state
        self.stall_s = stall_s  # a push's transfer with no bucket out for this long is given up
        self._owner: Owner | None = None
        self._members: list[int] = []  # id() of each engine in the owner's group, in rank order

    # -- ownership ----------------------------------------------------------------------------
    @property
    def owner(self) -> Owner | None:
        return self._owner

    @property
    def version(self) -> int:
        return self.state.version

    async def owner_status(self) -> dict | None:
        """The group that owns weight sync and whether its trainer still listens (None: no owner)."""
        if self._owner is None:
            return None
        return {"group_name": self._owner.group_name, "alive": await self._owner.alive()}

    async def take(self, owner: Owner, join: Callable[[list[EngineClient]], Awaitable[Any]],
                   take_over: bool = False) -> list[EngineClient]:
        """`owner` takes the sidecar's weight sync: `join(engines)` has the engines join its group,
        and those engines are returned. While another group owns it and its trainer lives, refused
        (OwnedElsewhere) unless `take_over`; a group that is replaced is left first."""
        old = self._owner
        if old is not None and old.group_name != owner.group_name:
            alive = await old.alive()
            if alive and not take_over:
                raise OwnedElsewhere(old)
            log.warning("weight-sync group %s %s: leaving it for group %s", old.group_name,
                        "taken over" if alive else "lost its trainer", owner.group_name)
            self.release(old)
            await old.leave(self.sidecar.up_engines(), False)
        engines = self.sidecar.up_engines()
        await join(engines)
        self._owner, self._members = owner, [id(e) for e in engines]
        return engines

    def release(self, owner: Owner | None = None) -> None:
        """`owner` (None: whichever) owns the weight sync no more; leaving its group is its front end's."""
        if owner is None or self._owner is owner:
            self._owner, self._members = None, []

    def check_version(self, version: int) -> None:
        """Versions only go up. Version 0 names the checkpoint's weights: a trainer's initial
        sync may push it while the sidecar still serves version 0."""
        if version < self.version or (version == self.version and version != 0):
            raise WeightSyncRefused(f"version {version} does not go up: this sidecar serves version "
                                    f"{self.version}; push a higher one")

    def engines_for(self, version: int | None, group_name: str | None) -> list[EngineClient]:
        """The engines a push over `group_name` lands on, once it may: that group owns the weight
        sync, `version` goes up (None: told at the finish), and the group holds every engine up."""
        if group_name and (self._owner is None or self._owner.group_name != group_name):
            raise WeightSyncRefused(f"push over group {group_name}, which does not own this sidecar's weight sync "
                                    f"(now {self._owner and self._owner.group_name}): another trainer took over")
        if version is not None:
            self.check_version(version)
        engines = self.sidecar.up_engines()
        if [id(e) for e in engines] != self._members:
            raise WeightSyncRegroup(f"this sidecar's engines changed since group {group_name} formed (an engine was "
                                    "restarted): init_weight_sync again (RolloutClient does so by itself)")
        return engines

    # -- the staged push ----------------------------------------------------------------------
    async def stage(self, engines: list[EngineClient], manifest: Manifest, timeout_s: float,
                    group_name: str | None = None, method: str = "begin_receive_weights") -> Staged:
        """Step 1: the bytes arrive while the engines generate (weight_sync.engine_side.engines.stage_on_engines,
        `method` on each). A trainer lost meanwhile (trainer_lost) gives the push up on every engine
        (TrainerLost; their staging memory goes now); an engine that failed makes every engine
        drop its staging and raises the reasons (WeightSyncError, or PushWithdrawn)."""
        t0, owner = time.monotonic(), self._owner
        staging = asyncio.ensure_future(stage_on_engines(engines, manifest, timeout_s, group_name, method))
        watch = asyncio.ensure_future(trainer_lost(owner, manifest.push_id, self.stall_s)) if owner else None
        with self.state.receiving():
            await asyncio.wait({staging} | ({watch} if watch else set()), return_when=asyncio.FIRST_COMPLETED)
        if not staging.done():  # the trainer is gone, failed or stalled: nothing to wait for
            staging.cancel()
            await owner.leave(engines, True)
            self.state.count("failed_pushes")  # once wound down: a caller who sees it may push again
            raise TrainerLost(f"push of version {manifest.version} failed: {watch.result()}; nothing was "
                              "committed and the engines never paused. init_weight_sync again")
        if watch is not None:
            watch.cancel()
        staged = staging.result()
        if any(r != "staged" for r in staged):  # every engine raises its reason; none commits
            results = await finish_on_engines(engines, staged, commit=False, timeout=timeout_s)
            await self._commit(engines, [r if isinstance(r, BaseException) else
                                         RuntimeError("dropped: another engine failed") for r in results],
                               manifest.version, manifest.push_id)
        return Staged(manifest, engines, staged, timeout_s, t0, time.monotonic() - t0)

    async def finish(self, staged: Staged, version: int, pause_mode: str | None, paused=False, method=FINISH) -> dict:
        """Steps 2-5: engines paused (`pause_mode`; `paused`: by the trainer), the swap, `version`, the count."""
        async def swap() -> dict:
            t1 = time.monotonic()
            results = await finish_on_engines(staged.engines, staged.results, True, staged.timeout_s, method)
            out = await self._commit(staged.engines, results, version, staged.manifest.push_id)
            return {**out, "swap_seconds": time.monotonic() - t1, "transfer_seconds": staged.transfer_seconds}

        if paused:
            out = await self.exclusive(swap)
        else:
            out = await self.sidecar.run_paused(pause_mode, swap)
        return self._counted(out, staged.started)

    async def push_paused(self, engines: list[EngineClient], manifest: Manifest, pause_mode: str | None,
                          receive: Callable[[], Awaitable[list]], on_paused=None, watched: bool = True) -> dict:
        """pause -> receive -> commit -> count, for a push the engines cannot take while they
        generate. `receive()` answers one result per engine; meanwhile the trainer is watched
        (`watched`), and engines stuck in a transfer that will not end are stopped."""
        t0 = time.monotonic()

        async def work() -> dict:
            t1 = time.monotonic()
            watchdog = asyncio.ensure_future(self._stop_stuck(engines, manifest.push_id)) \
                if watched and self._owner is not None else None
            try:
                results = await receive()
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            transfer = time.monotonic() - t1
            return {**await self._commit(engines, results, manifest.version, manifest.push_id),
                    "transfer_seconds": transfer}

        return self._counted(await self.sidecar.run_paused(pause_mode, work, on_paused), t0)

    async def load(self, path: str, version: int, pause_mode: str | None) -> dict:
        """The file fallback: every engine loads the push written at `path`, paused, and commits it."""
        self.check_version(version)

        async def work() -> dict:
            out = await load_on_engines(self.sidecar.up_engines(), path, version)
            self.sidecar.committed(version)
            return out

        out = await self.sidecar.run_paused(pause_mode, work)
        out.pop("worker_results", None)
        self.state.count("pushes")
        return out

    async def exclusive(self, work: Callable[[], Awaitable[Any]]) -> Any:
        """`work()` with no push committing meanwhile (never between a commit and its version)."""
        async with self.state.push_lock:
            return await work()

    # -- commit and count ---------------------------------------------------------------------
    async def _commit(self, engines: list[EngineClient], results: list, version: int, push_id: str) -> dict:
        """The engines' results of a push (weight_sync.engine_side.engines.commit_results); the sidecar
        serves its version once every engine committed it, and counts a failed push otherwise
        (unless its trainer withdrew it: PushWithdrawn). Engines left with torn weights (they
        answer EngineUnhealthyError) are stopped, to come back with the last committed ones."""
        torn = [e for e, r in zip(engines, results) if isinstance(r, EngineUnhealthyError)]
        if torn:
            self.sidecar.stop_engines(torn, "its weights are torn")
        try:
            out = await commit_results(engines, results, version, "push")
        except Exception as e:
            if await self._withdrawn(push_id, e):
                raise PushWithdrawn(f"push of version {version} withdrawn by its trainer before any byte "
                                    "moved: the layout it reused no longer fits its weights, it pushes them again "
                                    "on a fresh one") from e
            self.state.count("failed_pushes")
            raise
        self.sidecar.committed(version)
        return out

    async def _withdrawn(self, push_id: str, error: Exception) -> bool:
        """Whether a push refused before any byte moved was refused by its trainer's vote on the
        layout it reused (it marks that, WITHDRAWN_MARK, before voting; the workers only hear
        "refused by another rank")."""
        owner = self._owner
        if error_kind(error) != "refused" or owner is None or owner.store is None:
            return False
        try:
            return await asyncio.to_thread(PushProgress(owner.store, push_id).read) == WITHDRAWN_MARK
        except Exception:  # noqa: BLE001 - the trainer's store did not answer: a failed push, as before
            return False

    def _counted(self, out: dict, t0: float) -> dict:
        """A committed push's counters and reply (`out` holds its transfer_seconds)."""
        self.state.count("pushes")
        self.state.count("transfer_seconds", out["transfer_seconds"])
        self.state.count("push_seconds", time.monotonic() - t0)
        workers = out.pop("worker_results", None) or []
        # the slowest worker's delta apply (weight_sync/common/delta_push.py) and derived copies made
        # from the staged weights (engine/kernels/derived_weights.py), where the push had them
        for key in ("apply_seconds", "derive_seconds"):
            if seconds := [w[key] for w in workers if isinstance(w, dict) and key in w]:
                out[key] = max(seconds)
        phases = [w["phases"] for w in workers if isinstance(w, dict) and "phases" in w]
        if phases:  # the slowest worker's steps (weight_sync/common/phases.py)
            out["engine_phases"] = max(phases, key=lambda p: sum(p.values()))
        return {**out, **self.sidecar.serving(), "seconds": time.monotonic() - t0}

    async def _stop_stuck(self, engines: list[EngineClient], push_id: str) -> None:
        """The engines wait in a transfer that will not finish: stopped, and the supervisor restarts
        them with the last committed weights (host copy or sibling); nothing is committed."""
        why = await trainer_lost(self._owner, push_id, self.stall_s)
        self.sidecar.stop_engines(engines, f"{why}: stuck in its transfer")
