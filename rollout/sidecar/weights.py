"""The ZMQ protocol's weight calls (rollout/sidecar/server.py: InitWeightSync, PushWeights, LoadWeights,
CloseWeightSync), a front end over the sidecar's one staged push (rollout/sidecar/push_coordinator.py). What
is its own: our trainer's group (joined with weight_sync.engine_side.engines), and the choice of how a push
arrives: staged while the engines generate (--overlap-receive on), or paused for the transfer (off;
an engine with no room for a staging copy; a push from shared memory on this machine)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from rollout.sidecar.push_coordinator import Owner, PushCoordinator
from weight_sync.common.manifest import Manifest
from weight_sync.engine_side.engines import close_weight_sync, join_engines, receive_on_engines, workers_of

log = logging.getLogger(__name__)


async def leave_group(engines: Sequence, mid_push: bool) -> None:
    """The engines leave our trainer's group. Mid-push, the transfer arriving is given up (its
    staging memory goes now) and the staging buffer kept for the next push stays."""
    if mid_push:
        await asyncio.gather(*(e.collective_rpc("close_weight_sync", timeout=5, args=(False,)) for e in engines),
                             return_exceptions=True)
    else:
        await close_weight_sync(engines)


class SidecarWeights:
    """The ZMQ weight calls. `overlap`: receive a push while the engines generate, and pause them
    only for the swap; `staging_limit`: bytes of staging per engine (None: the device's free memory)."""

    def __init__(self, pushes: PushCoordinator, overlap: bool = True, staging_limit: int | None = None):
        self.pushes = pushes
        self.overlap = overlap
        self.staging_limit = staging_limit
        self._room_for: tuple | None = None  # (layout bytes, engines) that had room for staging last time

    @property
    def owner(self) -> Owner | None:
        """The trainer that owns the sidecar's weight sync, whichever front end it came by."""
        return self.pushes.owner

    async def init(self, host: str, port: int, world_size: int, rank_offset: int, group_name: str,
                   timeout_s: float, secret: str, take_over: bool = False) -> dict:
        info = {"host": host, "port": port, "world_size": world_size, "group_name": group_name,
                "timeout_s": timeout_s, "secret": secret}  # the secret included: never logged

        async def join(engines: list) -> None:
            await join_engines(engines, info, rank_offset, timeout=timeout_s + 30)

        owner = Owner(group_name, host, port, leave_group, store=info)
        engines = await self.pushes.take(owner, join, take_over)
        last = rank_offset + sum(workers_of(e) for e in engines) - 1
        log.info("joined weight-sync group %s as ranks %d..%d of %d", group_name, rank_offset, last, world_size)
        return {"ranks": list(range(rank_offset, last + 1))}

    async def push(self, manifest: Manifest, pause_mode: str | None, timeout_s: float, on_paused=None,
                   group_name: str | None = None, shared: dict | None = None) -> dict:
        """Over the group, or (`shared`: a weight_sync.trainer.shared_memory handle) from memory on this machine.
        (A malformed manifest never gets here: the call's decoding refuses it, rollout.common.protocol.)"""
        if shared:
            return await self._push_shared(manifest, pause_mode, timeout_s, on_paused, shared)
        engines = self.pushes.engines_for(manifest.version, group_name)
        if manifest.adapter is None and not await self._staging_fits(engines, manifest):
            return await self._push_in_place(engines, manifest, pause_mode, timeout_s, on_paused, group_name)
        if not self.overlap:
            return await self.pushes.push_paused(
                engines, manifest, pause_mode, lambda: receive_on_engines(engines, manifest, timeout_s, group_name),
                on_paused)
        staged = await self.pushes.stage(engines, manifest, timeout_s, group_name)
        return await self.pushes.finish(staged, manifest.version, pause_mode)

    async def _push_shared(self, manifest: Manifest, pause_mode: str | None, timeout_s: float, on_paused,
                           shared: dict) -> dict:
        """Every engine reads the trainer's buffer in shared memory (weight_sync.trainer.shared_memory), paused."""
        self.pushes.check_version(manifest.version)
        engines = self.pushes.sidecar.up_engines()

        async def receive() -> list:
            calls = [e.collective_rpc("receive_weights_shared", timeout=timeout_s, args=(manifest.to_wire(), shared))
                     for e in engines]
            return await asyncio.gather(*calls, return_exceptions=True)

        return await self.pushes.push_paused(engines, manifest, pause_mode, receive, on_paused, watched=False)

    async def _push_in_place(self, engines: list, manifest: Manifest, pause_mode: str | None, timeout_s: float,
                             on_paused, group_name: str | None) -> dict:
        """Each bucket written straight into the weights (weight_sync.engine_side.inplace_receive), paused for
        the transfer; an engine torn by a transfer that failed half way is restarted."""
        async def receive() -> list:
            self.pushes.state.count("inplace_pushes")
            return await receive_on_engines(engines, manifest, timeout_s, group_name, "receive_weights_inplace")

        return await self.pushes.push_paused(engines, manifest, pause_mode, receive, on_paused)

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

    async def load(self, path: str, version: int, pause_mode: str | None) -> dict:
        return await self.pushes.load(path, version, pause_mode)

    async def close(self, group_name: str | None = None) -> bool:
        """The trainer of group `group_name` (None: whichever) owns the weight sync no more, and the
        engines leave its group; False, with nothing changed, when another group owns it."""
        owner = self.pushes.owner
        if group_name is not None and owner is not None and owner.group_name != group_name:
            return False
        self.pushes.release()
        await close_weight_sync(self.pushes.sidecar.up_engines())
        return True
