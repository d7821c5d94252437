"""Engine supervision: the rollout manager's engines kept serving through engine deaths.

An engine whose core dies (killed, OOM, a failed forward: engine/async_engine.py) leaves the
rotation at once; its requests are resubmitted by the manager. The supervisor restarts it with
backoff, at most `max_restarts` times in `restart_window_s` (after that the engine stays "dead"
and the sidecar's health says why), and lets it back into the rotation only once it holds the
newest committed weights and version:

1. from the host copy: after each committed push one engine writes the weights to /dev/shm in
   the background (one model's bytes of RAM; `host_copy=False` saves them);
2. else from a live sibling engine, which writes its weights to /dev/shm for the new one then;
3. else it waits, out of the rotation, for the trainer's next push (the client re-forms the
   weight-sync group by itself, see rollout/sidecar/push_coordinator.py).

States per engine (health's `engine_states`): "live" (serving), "restarting" (being restarted
or catching up), "dead" (restart budget spent, or nothing to restart it with).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence

from engine import EngineClient
from engine.errors import EngineDeadError
from rollout.sidecar.state import SidecarState
from weight_sync.common.shm_names import STAGING_PREFIX, owned_name, sweep_orphans
from weight_sync.engine_side.engines import load_on_engines

log = logging.getLogger(__name__)

LIVE, RESTARTING, DEAD = "live", "restarting", "dead"


class NoEngineError(EngineDeadError):
    """No engine can serve, and none is being restarted."""

    error_kind = "gone"  #: a client of several sidecars sends the work to the others


SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# the weight copies this module writes; named by owner pid so a killed sidecar's are swept
HOST_COPY_PREFIX, CATCH_UP_PREFIX = "rollout-host-copy-", "rollout-catch-up-"


def _owned_dir(prefix: str) -> str:
    path = os.path.join(SHM_DIR, owned_name(prefix))
    os.mkdir(path, 0o700)
    return path


class EngineSupervisor:
    def __init__(self, engines: list[EngineClient], state: SidecarState, factory: Callable[..., EngineClient] | None = None,
                 max_restarts: int = 3, restart_window_s: float = 600.0, backoff_s: float = 0.5,
                 host_copy: bool = True, spawn_standby: Callable[[], subprocess.Popen] | None = None):
        """`factory(i, standby)` builds engine i afresh, from `standby` (a warm core process from
        `spawn_standby`, kept ready while the engines serve) when given one. `state`: the
        sidecar's (rollout.sidecar.state): its version is what a restarted engine catches up to,
        its push lock keeps pushes out meanwhile, and deaths and restarts are counted there."""
        self.engines = engines
        self.state = state
        for path in sweep_orphans((HOST_COPY_PREFIX, CATCH_UP_PREFIX, STAGING_PREFIX), SHM_DIR):
            log.info("removed %s, left by a sidecar or an engine that died", path)
        self.factory = factory
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.backoff_s = backoff_s
        self.host_copy = host_copy and factory is not None
        n = len(engines)
        self.states = [LIVE] * n
        self.reasons = [""] * n
        self.restarts = [0] * n
        self.stale = [False] * n  # up, but waiting for the trainer's next push (no weights to catch up from)
        self._attempts: list[list[float]] = [[] for _ in range(n)]  # restart times, for the budget
        self._changed = asyncio.Event()  # set whenever an engine's state changes
        self._tasks: set[asyncio.Task] = set()
        self._watch: asyncio.Task | None = None
        self._host_dir: str | None = None  # the newest committed weights, as a push directory
        self._host_task: asyncio.Task | None = None
        self._host_version: int | None = None
        self._in_use: dict[str, int] = {}  # host copies being sent to another sidecar: kept until sent
        self.weights_pushed = False  # the engines hold other weights than their checkpoint
        self.last_restart: dict | None = None  # what the last restart cost, stage by stage (stats)
        self.closed = False
        self.spawn_standby = spawn_standby if factory is not None else None
        self._standby: subprocess.Popen | None = None

    # -- which engines ------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if s == LIVE and not self.engines[i].errored]

    def up(self) -> list[int]:
        """Engines that take part in weight sync: live ones and restarted ones waiting for a push."""
        return [i for i, s in enumerate(self.states)
                if not self.engines[i].errored and (s == LIVE or (s == RESTARTING and self.stale[i]))]

    async def wait_live(self) -> list[int]:
        """The live engines, waiting while none is but one is being restarted; raises
        EngineDeadError when no engine can serve any more."""
        while True:
            self.check()
            live = self.live()
            if live:
                return live
            if RESTARTING not in self.states:
                raise NoEngineError("no engine can serve: " + "; ".join(
                    f"engine {i}: {r or 'dead'}" for i, r in enumerate(self.reasons)))
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    # -- death and restart --------------------------------------------------------------------
    def start(self) -> None:
        """Watch the engines (a core that dies while idle is noticed within 0.2 s), and keep a
        warm standby core ready for the next restart."""
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_engines())
            self._refill_standby()

    def _refill_standby(self) -> None:
        if self.spawn_standby is not None and not self.closed and (self._standby is None or self._standby.poll() is not None):
            self._standby = self.spawn_standby()

    def _take_standby(self) -> subprocess.Popen | None:
        standby, self._standby = self._standby, None
        return standby if standby is not None and standby.poll() is None else None

    async def _watch_engines(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(0.2)

    def check(self) -> None:
        for i, e in enumerate(self.engines):
            if self.states[i] == LIVE and e.errored:
                self.engine_died(i, e.dead_reason or "engine core process died")

    def engine_died(self, i: int, reason: str) -> None:
        if self.states[i] != LIVE or self.closed:  # (closed: the sidecar is shutting its engines down)
            return
        log.error("engine %d died: %s", i, reason)
        self.state.count("engine_deaths")
        self.reasons[i] = reason
        self._set(i, RESTARTING)
        self._spawn(self._restart(i))

    def stop(self, engines: Sequence[EngineClient], why: str) -> None:
        """Stop these engines' processes (their weights are torn, or they wait in a transfer that
        will not end): each is seen dead and restarted with the newest committed weights."""
        for i, e in enumerate(self.engines):
            if any(e is s for s in engines) and e.proc.poll() is None:
                log.error("engine %d: %s; restarting it", i, why)
                e.proc.kill()

    def _within_budget(self, i: int) -> bool:
        now = time.monotonic()
        self._attempts[i] = [t for t in self._attempts[i] if now - t < self.restart_window_s]
        return len(self._attempts[i]) < self.max_restarts

    async def _restart(self, i: int) -> None:
        old = self.engines[i]
        await asyncio.to_thread(old.shutdown, 1.0)
        while True:
            if self.factory is None or not self._within_budget(i):
                why = ("no way to restart it" if self.factory is None else
                       f"restart budget spent ({self.max_restarts} restarts in {self.restart_window_s:.0f} s)")
                self.reasons[i] = f"{self.reasons[i]}; {why}"
                log.error("engine %d stays dead: %s", i, why)
                self._set(i, DEAD)
                return
            await asyncio.sleep(self.backoff_s * 2 ** len(self._attempts[i]))
            self._attempts[i].append(time.monotonic())
            t0 = time.monotonic()
            new = None
            try:
                standby = self._take_standby()
                new = await asyncio.to_thread(self.factory, i, standby)
                self._refill_standby()  # for the next one
                t_started = time.monotonic()
                async with self.state.push_lock:  # no push commits while the new engine catches up
                    t_locked = time.monotonic()
                    source = await self._catch_up(i, new)
                    caught_up = source is not None
                    self.last_restart = {"engine": i, "start_s": t_started - t0, "lock_wait_s": t_locked - t_started,
                                         "catch_up_s": time.monotonic() - t_locked, "source": source or "next push"}
                    self.engines[i] = new
                    self.restarts[i] += 1
                    self.stale[i] = not caught_up
                    self.state.count("engine_restarts")
                    if caught_up:
                        self.reasons[i] = ""
                        self._set(i, LIVE)
                log.warning("engine %d restarted in %.1f s%s", i, time.monotonic() - t0,
                            "" if caught_up else "; it serves after the trainer's next push")
                sweep_orphans((STAGING_PREFIX,), SHM_DIR)  # the dead core's staging buffers (a host copy links
                return                                      # the one it needs)
            except Exception as e:  # noqa: BLE001 - a failed restart is retried within the budget
                log.error("restart of engine %d failed: %s", i, e)
                self.reasons[i] = f"restart failed: {e}"
                if new is not None:
                    await asyncio.to_thread(new.shutdown, 1.0)

    async def _catch_up(self, i: int, new: EngineClient) -> str | None:
        """Give `new` the newest committed weights and version; returns where they came from,
        None when there is nothing to take them from (it then waits for the trainer's next push)."""
        version = self.state.version
        if not self.weights_pushed:  # the checkpoint it loaded is what the others serve
            await new.set_weight_version(version)
            return "checkpoint"
        try:
            async with self.newest_weights(exclude=i, locked=True) as (path, version, source):
                await load_on_engines([new], path, version)
        except NoEngineError:
            return None
        log.info("engine %d caught up from %s (version %d)", i, source, version)
        return source

    @property
    def host_copy_version(self) -> int | None:
        return self._host_version

    @contextlib.asynccontextmanager
    async def newest_weights(self, exclude: int | None = None, locked: bool = False):
        """The newest committed weights as a push directory, kept until the caller is done (an
        engine or a sidecar catching up reads from it): yields (path, version, where from). The
        host copy when it holds them (a refresh meanwhile leaves it to this caller to remove), else
        written now from a live engine other than `exclude`, with no commit meanwhile (`locked`:
        the caller holds the push lock already), and removed after."""
        if self._host_task is not None:
            await asyncio.gather(self._host_task, return_exceptions=True)
        path = self._host_dir
        if path is not None and self._host_version == self.state.version:
            self._in_use[path] = self._in_use.get(path, 0) + 1
            try:
                yield path, self._host_version, "host copy"
            finally:
                self._in_use[path] -= 1
                if not self._in_use[path]:
                    del self._in_use[path]
                    if path != self._host_dir:  # superseded while it was sent
                        shutil.rmtree(path, ignore_errors=True)
            return
        live = [j for j in self.live() if j != exclude]
        if not live:
            raise NoEngineError("no live engine holds the weights to send")
        path = _owned_dir(CATCH_UP_PREFIX)
        try:
            async with contextlib.nullcontext() if locked else self.state.push_lock:
                version = self.state.version
                await self.engines[live[0]].collective_rpc("save_weights", args=(path, version))
            yield path, version, f"engine {live[0]}"
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # -- after each push ----------------------------------------------------------------------
    def committed(self, version: int) -> None:
        """A push or load committed on every engine that is up: stale engines are current now,
        and the host copy is refreshed in the background (the push does not wait for it)."""
        self.weights_pushed = True
        for i in self.up():
            if self.stale[i]:
                self.stale[i] = False
                self.reasons[i] = ""
                self._set(i, LIVE)
        if self.host_copy:
            self._host_task = self._spawn(self._refresh_host_copy(version, self._host_task))

    async def _refresh_host_copy(self, version: int, previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        live = self.live()
        if not live or version != self.state.version:
            return
        path = _owned_dir(HOST_COPY_PREFIX)
        try:
            out = await save_in_background(self.engines[live[0]], path, version)
        except BaseException as e:  # cancelled (close) too: a half-written copy is removed either way
            shutil.rmtree(path, ignore_errors=True)
            if not isinstance(e, Exception):
                raise
            log.warning("host copy of version %d failed: %s", version, e)
            return
        old, self._host_dir, self._host_version = self._host_dir, path, version
        if old and old not in self._in_use:  # one being sent is removed by its sender
            shutil.rmtree(old, ignore_errors=True)
        log.debug("host copy of version %d: %s", version, out)

    # -- plumbing -----------------------------------------------------------------------------
    def _set(self, i: int, state: str) -> None:
        self.states[i] = state
        self._changed.set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        self.closed = True
        for t in [self._watch, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*[t for t in [self._watch, *self._tasks] if t is not None], return_exceptions=True)
        if self._host_dir:
            shutil.rmtree(self._host_dir, ignore_errors=True)
        if self._standby is not None and self._standby.poll() is None:
            self._standby.kill()
            self._standby.wait()


async def save_in_background(engine, path: str, version: int) -> dict:
    """An engine's weights written to `path` by a thread of its worker (save_weights with
    background=True): the engine stops only for the host snapshot, not for the write; answered
    once written. Raises what the write raised."""
    return (await engine.collective_rpc("save_weights", args=(path, version), kwargs={"background": True}))[0]
