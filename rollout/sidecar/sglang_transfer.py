"""SGLang's RL weight API, spoken by the sidecar (issue 51), so that trainers written for SGLang servers
(slime, miles, AReaL, verl's SGLang rollouts, TorchRL's SGLang weight sync) drive it unchanged. The HTTP
routes are rollout/sidecar/openai_front/sglang_routes.py; this is what they do, a front end over the sidecar's one
staged push (rollout/sidecar/push_coordinator.py), with its guarantees:

- `init`: every engine's workers join the trainer's group (weight_sync/sglang/group.py) at the trainer's
  `rank_offset` (the workers before them added, as SGLang's TP workers take `rank_offset + tp_rank`),
  through the group all foreign front ends stand on (foreign_group.py). One trainer owns the sidecar's
  weight sync at a time.
- `update_distributed`: each call names a bucket of the update; its names, dtypes and shapes are checked
  against the model before any byte is read (a wrong one is a 400 naming it, nothing changed, and the
  engines leave the group so that the trainer's broadcast fails instead of waiting); its bytes land in
  staging while the engines serve and are held there. The update commits, on every engine at one step,
  once its calls have covered every weight, or at /continue_generation: never a mix of the update's
  buckets and the weights before them. A trainer gone mid-update (even between calls) changes nothing.
- `weight_version` (digits: ours are integers that go up; none: the current + 1) tags every token
  generated after the commit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout.sidecar.foreign_group import ForeignGroup, TransferError
from rollout.sidecar.push_coordinator import PushCoordinator, Staged, WeightSyncRefused
from weight_sync.sglang.group import BACKENDS
from weight_sync.sglang.wire import tied_aliases, update_parts
from weight_sync.common.votes import WeightSyncError

if TYPE_CHECKING:
    from rollout.sidecar.manager import RolloutManager

log = logging.getLogger(__name__)

PAUSE_MODES = {"abort": "abort", "retract": "abort", "in_place": "keep"}  # SGLang's -> ours (README: why)
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def _field(body: dict, key: str, kind: type, default=None):
    """body[key] as `kind` (a port may come as digits: AReaL sends it so, and SGLang's pydantic takes it)."""
    value = body.get(key, default)
    if kind is int and isinstance(value, str) and value.isdigit():
        value = int(value)
    if value is None or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TransferError(400, f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def init_fields(body: dict) -> dict:
    out = {k: _field(body, k, kind, default) for k, kind, default in
           (("master_address", str, None), ("master_port", int, None), ("rank_offset", int, None),
            ("world_size", int, None), ("group_name", str, DEFAULT_GROUP))}
    out["backend"] = body.get("backend")  # none: the engines' own (SGLang's default, "nccl", is CUDA's)
    if out["backend"] is not None and out["backend"] not in BACKENDS:
        raise TransferError(400, f"backend: {out['backend']!r} is not one of {sorted(BACKENDS)}")
    if out["rank_offset"] < 1 or out["world_size"] < 2:
        raise TransferError(400, "rank_offset: >= 1 (rank 0 is the trainer), world_size: >= 2")
    return out


def parse_version(weight_version, default: int) -> int:
    if weight_version is None:
        return default
    if isinstance(weight_version, str) and weight_version.isdigit():
        return int(weight_version)
    raise TransferError(400, f"weight_version: {weight_version!r} is not digits (this sidecar's weight versions are "
                             "integers that go up; leave it out for the current + 1)")


@dataclass
class _Update:
    """An update whose calls are held, uncommitted, on every engine."""

    version: int
    engines: list
    names: set[str] = field(default_factory=set)
    t0: float = field(default_factory=time.monotonic)
    transfer_s: float = 0.0
    last: Staged | None = None


class SglangTransfer:
    """SGLang's weight calls over a foreign trainer's group (`group`: its init body, its ownership,
    the update held in parts, the pause a trainer asks for with /pause_generation). Its own: SGLang's
    init fields and group names, updates cut into calls that commit once whole, tied weights a
    trainer may send twice, loads from disk."""

    def __init__(self, manager: RolloutManager, pushes: PushCoordinator, timeout_s: float = 300.0):
        self.manager, self.pushes, self.timeout_s = manager, pushes, timeout_s
        self.group = ForeignGroup(manager, pushes, timeout_s, join_method="join_sglang_group",
                                  init_call="/init_weights_update_group", pause_modes=PAUSE_MODES)
        self.weight_names: set[str] = set()
        self.receiving = 0  # update calls whose bytes are arriving now
        self.tied: dict[str, str] = {}  # alias -> served name, tied weights a trainer may send twice

    def world_size(self) -> int:
        """The ranks this sidecar's workers take in a trainer's group (SGLang's tp_size)."""
        return self.group.world_size()

    def _owns(self, group_name: str) -> bool:
        return self.group.owns() and self.group.info["group_name"] == group_name

    def _busy(self) -> str:
        return "mid-update" if self.group.update is not None or self.receiving else "between updates"

    # -- the group ------------------------------------------------------------------------------
    async def init(self, body: dict) -> None:
        info = init_fields(body)
        devices = {str(e.cfg.device).split(":")[0] for e in self.manager.up_engines()}
        if info["backend"] is None:  # TorchRL's SGLangCollectiveTransport sends none
            info["backend"] = "nccl" if devices == {"cuda"} else "gloo"
        if devices != {BACKENDS[info["backend"]]}:
            raise TransferError(400, f"backend: {info['backend']!r} cannot reach engines on {sorted(devices)}: use "
                                     f"{'nccl' if devices == {'cuda'} else 'gloo'}")
        self.group.check_room(info)

        def join_args(rank: int) -> tuple:
            return (info["master_address"], info["master_port"], info["world_size"], rank, info["group_name"],
                    info["backend"], self.timeout_s)

        def owned(group: str) -> str:
            return (f"the weight sync of this sidecar is owned by another trainer (group {group}, {self._busy()}), "
                    "which still lives: it must /destroy_weights_update_group first; nothing changed")

        where = f"{info['master_address']}:{info['master_port']}"
        engines = await self.group.take(f"sglang:{info['group_name']}@{where}", info, join_args, owned)
        self.weight_names = set((await engines[0].collective_rpc("weight_names", timeout=self.timeout_s))[0])
        self.tied = tied_aliases(await asyncio.to_thread(_ties_embeddings, engines[0].cfg.model), self.weight_names)
        log.info("joined an SGLang trainer's group %s at %s as ranks %d..%d of %d", info["group_name"], where,
                 info["rank_offset"], info["rank_offset"] + self.world_size() - 1, info["world_size"])

    async def destroy(self, group_name: str) -> None:
        if not self._owns(group_name):
            raise TransferError(400, f"group {group_name!r} does not exist here")
        await self.group.leave()

    # -- the update -----------------------------------------------------------------------------
    async def update_distributed(self, body: dict) -> dict:
        group = body.get("group_name", DEFAULT_GROUP)
        g = self.group
        if not self._owns(group) and g.info is not None and await g.owner.alive():
            raise TransferError(409, f"group_name: group {group!r} is not this sidecar's: its weight sync is owned "
                                     f"by another trainer's group {g.info['group_name']!r} ({self._busy()}), "
                                     "which still lives; nothing changed")
        if not self._owns(group):
            raise TransferError(400, f"group_name: group {group!r} does not exist here: /init_weights_update_group "
                                     "first")
        pending = g.update
        version = parse_version(body.get("weight_version"), pending.version if pending else self.pushes.version + 1)
        if pending is not None and pending.version != version:  # the trainer moved on: its update is done
            await self._commit()
        try:
            parts = update_parts(body, version, self.tied)
        except ValueError as e:
            await g.leave()  # the trainer broadcasts meanwhile: it must not wait
            raise TransferError(400, f"{e}; nothing changed") from None
        if g.update is None:
            self._check_version(version)
        if body.get("abort_all_requests"):
            await self._abort_requests()
        for m in parts:  # one, or a tied weight's own (weight_sync/sglang/wire.py)
            await self._stage(m)
        out = {"weight_version": str(version), "committed": False}
        if self.weight_names <= g.update.names:  # every weight arrived: the update is whole
            out.update(await self._commit(), committed=True)
        return out

    def _check_version(self, version: int) -> None:
        try:
            self.pushes.check_version(version)
        except WeightSyncRefused:
            raise TransferError(400, f"weight_version {version} does not go up: this sidecar serves version "
                                     f"{self.pushes.version}; nothing changed") from None

    async def _stage(self, m) -> None:
        """One call's bytes into staging on every engine, then held there with the update's others
        (a held part is refused when a tied weight's bytes are not its parameter's)."""
        async def hold(engines: list) -> None:
            aliases = {k: v for k, v in self.tied.items() if k in m.names}
            await asyncio.gather(*(e.collective_rpc("hold_staged_part", timeout=self.timeout_s, args=(aliases,))
                                   for e in engines))

        self.receiving += 1
        try:
            staged = await self.group.stage(m, then=hold)
        finally:
            self.receiving -= 1
        u = self.group.update = self.group.update or _Update(m.version, staged.engines)
        u.names |= set(m.names)
        u.transfer_s += staged.transfer_seconds
        u.last = staged

    async def _commit(self) -> dict:
        """The held update swapped in on every engine at one step; version committed."""
        u, self.group.update = self.group.update, None
        if u is None:
            return {}
        staged = Staged(u.last.manifest, u.engines, ["staged"] * len(u.engines), self.timeout_s, u.t0, u.transfer_s)
        try:
            out = await self.pushes.finish(staged, u.version, "keep", paused=self.group.paused_mode is not None,
                                           method="commit_held_parts")
        except WeightSyncError as e:
            raise TransferError(500, f"weight update failed: {e}") from None
        return {"version": u.version, "seconds": out.get("seconds"), "swap_seconds": out.get("swap_seconds")}

    async def update_from_disk(self, body: dict) -> dict:
        """An HF checkpoint directory (or one of our push directories) loaded by every engine, all or
        nothing, swapped in at one step (weight_sync/common/push_dir.py)."""
        import tempfile

        from weight_sync.common.push_dir import checkpoint_as_push

        path = _field(body, "model_path", str)
        version = parse_version(body.get("weight_version"), self.pushes.version + 1)
        self._check_version(version)
        if body.get("abort_all_requests"):
            await self._abort_requests()
        with tempfile.TemporaryDirectory(prefix="sglang-disk-") as tmp:
            try:
                push = await asyncio.to_thread(checkpoint_as_push, path, version, tmp)
            except (OSError, ValueError) as e:
                raise TransferError(400, f"model_path: {path!r} holds no weights to load ({e}); nothing changed") \
                    from None
            try:
                out = await self.pushes.load(push, version, "keep")
            except WeightSyncError as e:
                said = "refused" if e.refused else "failed"
                raise TransferError(400 if e.refused else 500, f"update {said}, nothing changed: "
                                    + " | ".join(e.reasons)) from None
        return {"weight_version": str(version), "seconds": out.get("seconds")}

    async def _abort_requests(self) -> None:
        """SGLang's abort_all_requests: requests in flight are cut; ours go on from their tokens after."""
        engines = self.manager.up_engines()
        await asyncio.gather(*(e.pause_generation(mode="abort", clear_cache=False) for e in engines))
        if self.group.paused_mode is None:
            await asyncio.gather(*(e.resume_generation() for e in engines))

    # -- pause ----------------------------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        await self.group.pause(mode)

    async def resume(self) -> dict:
        """/continue_generation: an update still held is whole now (its trainer says so), then the
        engines go on. Held by a trainer that is gone (another process continues), it is dropped."""
        g, out = self.group, {}
        if g.update is not None and g.owner is not None and await g.owner.alive():
            out = await self._commit()
        elif g.update is not None:
            log.warning("the trainer of the update held for version %d is gone: dropped", g.update.version)
            await g.leave()
        await g.resume()
        return out


def _ties_embeddings(model_dir: str) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
