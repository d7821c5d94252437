"""vLLM's RL weight-transfer protocol, spoken by the sidecar (issue 40), so a trainer written for
`vllm serve`'s routes (`HTTPVLLMWeightSyncClient`, TRL's `vllm-serve` mode) drives it unchanged.
The HTTP routes are rollout/sidecar/openai_front/rl_routes.py; this is what they do, a front end over the
sidecar's one staged push (rollout/sidecar/push_coordinator.py), with its guarantees:

- `init`: every engine's workers join the trainer's group (weight_sync/vllm/group.py) at the rank
  offsets vLLM's workers take (`rank_offset` + the workers before them), through the group all
  foreign front ends stand on (foreign_group.py). One trainer owns the sidecar's weight sync at a
  time, as with our own client.
- `update`: the update's names, dtypes and shapes are checked against the model before any byte is
  read (a tied `lm_head.weight` may be left out, as `ModuleSource` does); the chunks land in
  staging while the engines keep generating. A refused or failed update changes nothing, and the
  sidecar leaves the group so that the trainer's broadcast fails instead of waiting.
- `finish`: only when every engine staged every chunk are the weights swapped in, all engines at
  one step; `weight_version` (digits: ours are integers; none: the current + 1) tags every token
  generated after it.
- `pause` / `resume`: the engines' own, with our modes; a token keeps the version it was made with.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from rollout.sidecar.foreign_group import ForeignGroup, TransferError
from rollout.sidecar.push_coordinator import PushCoordinator, WeightSyncRefused
from weight_sync.common.votes import WeightSyncError
from weight_sync.vllm import nccl_unique_id
from weight_sync.vllm.packing import DEFAULT_BUFFER_BYTES, update_manifest

if TYPE_CHECKING:
    from rollout.sidecar.manager import RolloutManager

log = logging.getLogger(__name__)

PAUSE_MODES = {mode: mode for mode in ("abort", "wait", "keep")}  # vLLM's modes are ours


def _init_fields(info: dict) -> dict:
    """init_info, checked: each problem names its field. The rendezvous is vLLM's either way:
    master_address + master_port (the trainer's TCPStore), or nccl_unique_id_b64 (CUDA workers)."""
    uid = info.get("nccl_unique_id_b64")
    has_address = info.get("master_address") is not None or info.get("master_port") is not None
    if uid is not None and has_address:
        raise TransferError(400, "init_info: pass nccl_unique_id_b64 or master_address/master_port, not both")
    out = {"nccl_unique_id_b64": None, "master_address": None, "master_port": None}
    if uid is not None:
        try:
            nccl_unique_id.from_b64(uid)
        except ValueError as e:
            raise TransferError(400, f"init_info.{e}") from None
        out["nccl_unique_id_b64"] = uid
    fields = [("world_size", int, None), ("rank_offset", int, 1), ("packed", bool, True),
              ("packed_buffer_size_bytes", int, DEFAULT_BUFFER_BYTES), ("packed_num_buffers", int, 2)]
    if uid is None:
        fields = [("master_address", str, None), ("master_port", int, None), *fields]
    for key, kind, default in fields:
        value = info.get(key, default)
        if value is None or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TransferError(400, f"init_info.{key}: expected {kind.__name__}, got {value!r}")
        out[key] = value
    if not out["packed"]:
        raise TransferError(400, "init_info.packed: only packed transfers are taken (vLLM's default)")
    if out["packed_buffer_size_bytes"] < 1 or out["world_size"] < 2 or out["rank_offset"] < 1:
        raise TransferError(400, "init_info: packed_buffer_size_bytes >= 1, world_size >= 2, rank_offset >= 1")
    return out


def _address(info: dict) -> str:
    """Where the trainer of `init_info` meets its workers, for people and the group's name."""
    if info["nccl_unique_id_b64"]:
        return "an NCCL unique id"
    return f"{info['master_address']}:{info['master_port']}"


class VllmTransfer:
    """vLLM's weight-transfer calls over a foreign trainer's group (`group`: its init_info, its
    ownership, the update staged between /update_weights and /finish_weight_update, the pause a
    trainer asks for with /pause). Its own: vLLM's init fields and rendezvous (a TCPStore address or
    an NCCL unique id), its packed updates, versions and weight checker."""

    def __init__(self, manager: RolloutManager, pushes: PushCoordinator, timeout_s: float = 300.0):
        self.manager, self.pushes, self.timeout_s = manager, pushes, timeout_s
        self.group = ForeignGroup(manager, pushes, timeout_s, join_method="join_vllm_group",
                                  init_call="/init_weight_transfer_engine", pause_modes=PAUSE_MODES)

    @property
    def paused_mode(self) -> str | None:
        return self.group.paused_mode

    def world_size(self) -> int:
        """The ranks a trainer's group needs for this sidecar's workers (vLLM's /get_world_size)."""
        return self.group.world_size()

    def _check_engines(self, info: dict) -> None:
        """Whether this sidecar's engines fit the group `info` describes (400 if not)."""
        on_cpu = [str(e.cfg.device) for e in self.manager.up_engines() if not str(e.cfg.device).startswith("cuda")]
        if info["nccl_unique_id_b64"] and on_cpu:
            raise TransferError(400, f"init_info.nccl_unique_id_b64: an NCCL group needs engines on CUDA; this "
                                     f"sidecar's are on {on_cpu[0]}: give master_address and master_port (gloo)")
        self.group.check_room(info)

    async def init(self, init_info: dict) -> None:
        info = _init_fields(init_info)
        self._check_engines(info)

        def join_args(rank: int) -> tuple:
            return (info["master_address"], info["master_port"], info["world_size"], rank, self.timeout_s,
                    info["nccl_unique_id_b64"])

        def owned(group: str) -> str:
            return (f"the weight sync of this sidecar is owned by another trainer (group {group}), which still "
                    "lives: it must /shutdown_weight_transfer_engine (or close_weight_sync) first")

        # an owner that sent an NCCL id has no port to watch: a new init takes over, as vLLM's would
        await self.group.take(f"vllm:{_address(info)}", info, join_args, owned, where=_address(info))
        log.info("joined a vLLM trainer's group at %s as ranks %d..%d of %d", _address(info),
                 info["rank_offset"], info["rank_offset"] + self.world_size() - 1, info["world_size"])

    async def update(self, update_info: dict) -> dict:
        g = self.group
        if not g.owns():
            raise TransferError(409, "no weight-transfer group: /init_weight_transfer_engine first")
        if g.update is not None:
            raise TransferError(409, "an update is staged already: /finish_weight_update it first")
        try:
            m = update_manifest(update_info, g.info["packed_buffer_size_bytes"], self.pushes.version + 1)
        except ValueError as e:
            await g.leave()  # the trainer broadcasts meanwhile: it must not wait
            raise TransferError(400, str(e)) from None
        g.update = await g.stage(m)
        return {"bytes": m.total_bytes, "chunks": len(m.buckets)}

    async def finish(self, weight_version: str | None) -> int:
        g = self.group
        if g.update is None:
            raise TransferError(409, "no update staged: /update_weights first")
        if weight_version is None:
            version = self.pushes.version + 1
        elif isinstance(weight_version, str) and weight_version.isdigit():
            version = int(weight_version)
        else:
            raise TransferError(400, f"weight_version: {weight_version!r} is not digits (this sidecar's weight "
                                     "versions are integers that go up; leave it out for the current + 1)")
        try:
            self.pushes.check_version(version)
        except WeightSyncRefused:
            raise TransferError(409, f"weight_version {version} does not go up: this sidecar serves version "
                                     f"{self.pushes.version}") from None
        staged, g.update = g.update, None
        try:  # paused by the trainer (/pause): swapped in as they are
            await self.pushes.finish(staged, version, "keep", paused=g.paused_mode is not None)
        except WeightSyncError as e:
            raise TransferError(500, f"weight update failed: {e}") from None
        return version

    async def relabel(self, new_version: str) -> None:
        """vLLM's /update_weight_version names the weights served now anew. Here a version names a
        push's weights (every token carries the one that made it, and peers catch up by it), so it
        changes only with new weights: the current one is accepted as is, any other refused."""
        if new_version != str(self.pushes.version):
            raise TransferError(409, f"new_version {new_version!r}: this sidecar's weight versions name the "
                                     f"pushes' weights (version {self.pushes.version} is served), so a version "
                                     "changes only with new weights: pass weight_version to /finish_weight_update")

    async def checksums(self) -> dict[str, str]:
        """SHA-256 of each served weight, keyed as vLLM's /weight_checker keys them
        ("dp<engine>:pp0:pcp0:tp<rank>:<name>")."""
        out = {}
        for i, e in enumerate(self.manager.up_engines()):
            per_rank = await e.collective_rpc("weight_digests", timeout=self.timeout_s)
            for rank, digests in enumerate(per_rank):
                out.update({f"dp{i}:pp0:pcp0:tp{rank}:{name}": d for name, d in digests.items()})
        return out

    async def zero(self) -> None:
        """Every engine's weights zeroed until the next push (vLLM's /weight_checker "reset")."""
        async def zero_all() -> None:
            await asyncio.gather(*(e.collective_rpc("zero_weights", timeout=self.timeout_s)
                                   for e in self.manager.up_engines()))

        try:
            await self.pushes.exclusive(zero_all)
        except ValueError as e:
            raise TransferError(400, f"action 'reset': {e}") from None

    async def pause(self, mode: str) -> None:
        await self.group.pause(mode)

    async def resume(self) -> None:
        await self.group.resume()

    async def shutdown(self) -> None:
        await self.group.leave()
