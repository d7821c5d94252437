"""A foreign trainer's group on the sidecar's engines: what the front ends for vLLM's RL routes
(vllm_transfer.py) and SGLang's (sglang_transfer.py) both do, over the sidecar's one staged push
(push_coordinator.py). Each front end keeps only what its protocol says differently: its init fields,
the workers' call that joins its group, how an update is cut into calls, its pause modes' names.

One trainer owns the sidecar's weight sync at a time (taken through the coordinator, which watches it).
The engines' workers join its group at its rank offset (the workers before them added); a refused or
failed update changes nothing and the engines leave the group, so that the trainer's broadcast fails
instead of waiting; a trainer gone mid-update changes nothing either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import RefusedError
from rollout.sidecar.push_coordinator import (
    OwnedElsewhere, Owner, PushCoordinator, Staged, TrainerLost, WeightSyncRefused,
)
from weight_sync.common.votes import WeightSyncError
from weight_sync.engine_side.engines import rank_offsets, workers_of

if TYPE_CHECKING:
    from rollout.sidecar.manager import RolloutManager

STAGE_METHOD = "begin_receive_foreign"  # the workers' receive over a foreign trainer's group
LEAVE_METHOD = "close_foreign_group"


class TransferError(Exception):
    """A call refused or failed, with the HTTP status it answers (4xx: nothing changed)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def leave_foreign_group(engines: Sequence, mid_push: bool = False) -> None:
    """The engines leave a foreign trainer's group; a transfer still arriving, and parts held, are given up."""
    del mid_push  # the same either way
    await asyncio.gather(*(e.collective_rpc(LEAVE_METHOD, timeout=10) for e in engines), return_exceptions=True)


def _reasons(e: Exception) -> str:
    return " | ".join(getattr(e, "reasons", None) or [str(e)])


class ForeignGroup:
    """The group of the trainer a foreign front end serves, and everything that goes with it: the
    ownership taken for it (`owner`), its init fields (`info`, the protocol's), the update staged or
    held for it (`update`, the protocol's), and the pause it asked for (`paused_mode`)."""

    def __init__(self, manager: RolloutManager, pushes: PushCoordinator, timeout_s: float, *,
                 join_method: str, init_call: str, pause_modes: dict[str, str]):
        self.manager, self.pushes, self.timeout_s = manager, pushes, timeout_s
        self.join_method = join_method  # the workers' call that joins this protocol's group
        self.init_call = init_call  # the route a refused trainer starts over with, for its error
        self.pause_modes = pause_modes  # the protocol's mode -> ours
        self.owner: Owner | None = None
        self.info: dict | None = None
        self.update: Any = None
        self.paused_mode: str | None = None
        self.where = "?"  # where the owning trainer listens, for people

    def world_size(self) -> int:
        """The ranks this sidecar's workers take in a trainer's group."""
        return sum(workers_of(e) for e in self.manager.up_engines())

    def owns(self) -> bool:
        """Whether the trainer this front end joined still owns the weight sync (none took over)."""
        return self.owner is not None and self.pushes.owner is self.owner

    def check_room(self, info: dict) -> None:
        """Whether the group `info` describes holds this sidecar's workers at its rank offset (400 if not)."""
        if info["rank_offset"] + self.world_size() > info["world_size"]:
            raise TransferError(400, f"world_size: {info['world_size']} ranks cannot hold rank_offset "
                                     f"{info['rank_offset']} + this sidecar's {self.world_size()} workers")

    async def take(self, name: str, info: dict, join_args: Callable[[int], tuple],
                   owned: Callable[[str], str], where: str | None = None) -> list:
        """The trainer of `info` owns the weight sync: every engine's workers joined its group (the
        previous one left, with its update). `join_args(rank)`: the join call's arguments for the
        workers from `rank` on; `owned(group)`: the 409's words when a live trainer owns it already."""
        owner = Owner(name, info["master_address"], info["master_port"], leave_foreign_group)
        try:
            engines = await self.pushes.take(owner, lambda engines: self._join(engines, info, join_args))
        except OwnedElsewhere as e:  # nothing changed
            raise TransferError(409, owned(e.owner.group_name)) from None
        except BaseException:
            self.forget()
            raise
        self.info, self.owner = info, owner
        self.where = where or f"{info['master_address']}:{info['master_port']}"
        return engines

    async def _join(self, engines: list, info: dict, join_args: Callable[[int], tuple]) -> None:
        self.update = None
        await leave_foreign_group(engines)
        offsets = rank_offsets(engines, info["rank_offset"])
        joined = await asyncio.gather(*(e.collective_rpc(self.join_method, timeout=self.timeout_s, args=join_args(off))
                                        for e, off in zip(engines, offsets)), return_exceptions=True)
        errors = [str(r) for r in joined if isinstance(r, BaseException)]
        if errors:
            await leave_foreign_group(engines)
            raise TransferError(502, "could not join the trainer's group: " + "; ".join(errors))

    async def stage(self, manifest, then: Callable[[list], Awaitable[None]] | None = None) -> Staged:
        """One update's bytes (`manifest`) into staging on every engine while they serve, then
        `then(engines)` (a protocol that holds its parts). Each failure answers a TransferError
        with nothing changed: the trainer gone (502), an engine restarted since the group formed
        (409), the update refused (400) or failed (500); the group is left after the last three."""
        where = self.where
        try:
            engines = self.pushes.engines_for(None, self.owner.group_name)
            staged = await self.pushes.stage(engines, manifest, self.timeout_s, method=STAGE_METHOD)
            if then is not None:
                await then(engines)
            return staged
        except TrainerLost:  # its transfer was given up on every engine
            self.forget()
            raise TransferError(502, f"the trainer at {where} is gone mid-update; nothing changed, the engines "
                                     "serve on") from None
        except WeightSyncRefused as e:  # the sidecar's state refuses: an engine restarted since the group formed
            await self.leave()
            raise TransferError(409, f"{e}; {self.init_call} again") from None
        except RefusedError as e:  # the update does not fit (a worker's vote, a held part's check)
            await self.leave()
            raise TransferError(400, f"update refused, nothing changed: {_reasons(e)}") from None
        except WeightSyncError as e:
            await self.leave()
            raise TransferError(500, f"update failed, nothing changed: {_reasons(e)}") from None

    async def pause(self, mode: str) -> None:
        if mode not in self.pause_modes:
            raise TransferError(400, f"mode: {mode!r} is not one of {sorted(self.pause_modes)}")
        ours = self.pause_modes[mode]
        await asyncio.gather(*(e.pause_generation(mode=ours, clear_cache=False) for e in self.manager.up_engines()))
        self.paused_mode = mode

    async def resume(self) -> None:
        await asyncio.gather(*(e.resume_generation() for e in self.manager.up_engines()))
        self.paused_mode = None

    def forget(self) -> None:
        """The trainer's group is gone from here: its update, its init fields and its ownership."""
        self.update, self.info = None, None
        if self.owner is not None:
            self.pushes.release(self.owner)
        self.owner = None

    async def leave(self) -> None:
        """Every engine leaves the trainer's group (a transfer still arriving is given up)."""
        self.forget()
        await leave_foreign_group(self.manager.up_engines())
