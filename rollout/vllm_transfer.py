"""vLLM's RL weight-transfer protocol, spoken by the sidecar (issue 40), so a trainer written for
`vllm serve`'s routes (`HTTPVLLMWeightSyncClient`, TRL's `vllm-serve` mode) drives it unchanged.
The HTTP routes are rollout/openai_front/rl_routes.py; this is what they do, on our guarantees:

- `init`: every engine's workers join the trainer's group (weight_sync/vllm/group.py) at the rank
  offsets vLLM's workers take (`rank_offset` + the workers before them). One trainer owns the
  sidecar's weight sync at a time, as with our own client.
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

from rollout.weights import trainer_reachable
from weight_sync.engine_side.engines import (
    commit_results, finish_on_engines, rank_offsets, stage_on_engines, workers_of,
)
from weight_sync.vllm import nccl_unique_id
from weight_sync.vllm.packing import DEFAULT_BUFFER_BYTES, update_manifest

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class TransferError(Exception):
    """A call refused or failed, with the HTTP status it answers (4xx: nothing changed)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


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


class VllmTransfer:
    def __init__(self, manager, weights, timeout_s: float = 300.0):
        self.manager, self.weights, self.timeout_s = manager, weights, timeout_s
        self.info: dict | None = None  # the owning trainer's init_info
        self.staged: tuple | None = None  # (manifest, engines, their staged states) of an update not yet finished
        self.paused_mode: str | None = None  # the engines were paused by /pause

    @property
    def info_address(self) -> str:
        if not self.info:
            return "?"
        if self.info["nccl_unique_id_b64"]:
            return "an NCCL unique id"
        return f"{self.info['master_address']}:{self.info['master_port']}"

    def world_size(self) -> int:
        """The ranks a trainer's group needs for this sidecar's workers (vLLM's /get_world_size)."""
        return sum(workers_of(e) for e in self.manager.up_engines())

    async def init(self, init_info: dict) -> None:
        info = _init_fields(init_info)
        owner = self.weights.owner
        mine = owner is not None and (owner["host"], owner["port"]) == (info["master_address"], info["master_port"])
        # an owner that sent an NCCL id has no port to watch: a new init takes over, as vLLM's would
        if owner is not None and not mine and owner["host"] is not None and (await self.weights.owner_status())["alive"]:
            raise TransferError(409, f"the weight sync of this sidecar is owned by another trainer (group "
                                     f"{owner['group_name']}), which still lives: it must "
                                     "/shutdown_weight_transfer_engine (or close_weight_sync) first")
        engines = self.manager.up_engines()
        on_cpu = [str(e.cfg.device) for e in engines if not str(e.cfg.device).startswith("cuda")]
        if info["nccl_unique_id_b64"] and on_cpu:
            raise TransferError(400, f"init_info.nccl_unique_id_b64: an NCCL group needs engines on CUDA; this "
                                     f"sidecar's are on {on_cpu[0]}: give master_address and master_port (gloo)")
        last = info["rank_offset"] + self.world_size()
        if last > info["world_size"]:
            raise TransferError(400, f"init_info.world_size: {info['world_size']} ranks cannot hold rank_offset "
                                     f"{info['rank_offset']} + this sidecar's {self.world_size()} workers")
        await self._leave(engines)
        offsets = rank_offsets(engines, info["rank_offset"])
        joined = await asyncio.gather(*(e.collective_rpc(
            "join_vllm_group", timeout=self.timeout_s,
            args=(info["master_address"], info["master_port"], info["world_size"], off, self.timeout_s,
                  info["nccl_unique_id_b64"]))
            for e, off in zip(engines, offsets)), return_exceptions=True)
        errors = [str(r) for r in joined if isinstance(r, BaseException)]
        if errors:
            await self._leave(engines)
            raise TransferError(502, "could not join the trainer's group: " + "; ".join(errors))
        self.info = info
        self.weights.owner = {"host": info["master_address"], "port": info["master_port"],
                              "group_name": f"vllm:{self.info_address}"}
        self.weights.members = [id(e) for e in engines]
        log.info("joined a vLLM trainer's group at %s as ranks %d..%d of %d", self.info_address,
                 info["rank_offset"], last - 1, info["world_size"])

    async def update(self, update_info: dict) -> dict:
        if self.info is None:
            raise TransferError(409, "no weight-transfer group: /init_weight_transfer_engine first")
        if self.staged is not None:
            raise TransferError(409, "an update is staged already: /finish_weight_update it first")
        try:
            m = update_manifest(update_info, self.info["packed_buffer_size_bytes"], self.manager.version + 1)
        except ValueError as e:
            await self._leave(self.manager.up_engines())  # the trainer broadcasts meanwhile: it must not wait
            raise TransferError(400, str(e)) from None
        engines = self.manager.up_engines()
        with self.manager.state.receiving():
            staging = asyncio.ensure_future(stage_on_engines(engines, m, self.timeout_s, method="begin_receive_vllm"))
            watch = asyncio.ensure_future(self._trainer_gone())
            await asyncio.wait({staging, watch}, return_when=asyncio.FIRST_COMPLETED)
            watch.cancel()
            if not staging.done():  # the trainer died mid-update: its transfer is given up on every engine
                where = self.info_address
                await self._leave(engines)
                await asyncio.gather(staging, return_exceptions=True)
                self.manager.state.count("failed_pushes")
                raise TransferError(502, f"the trainer at {where} is gone mid-update; nothing changed, "
                                         "the engines serve on")
            staged = staging.result()
        if any(r != "staged" for r in staged):
            results = await finish_on_engines(engines, staged, commit=False, timeout=self.timeout_s)
            reasons = [str(r) for r in results if isinstance(r, BaseException)]
            refused = all(getattr(r, "refused", False) or getattr(r, "kind", "") == "refused"
                          for r in results if isinstance(r, BaseException))
            await self._leave(engines)
            self.manager.state.count("failed_pushes")
            raise TransferError(400 if refused else 500, "weight update " + ("refused" if refused else "failed") +
                                ", nothing changed: " + " | ".join(reasons or ["another engine failed"]))
        self.staged = (m, engines, staged)
        return {"bytes": m.total_bytes, "chunks": len(m.buckets)}

    async def _trainer_gone(self, period_s: float = 0.5, misses: int = 2) -> None:
        """Returns once the trainer's rendezvous port (its group's store, which lives as long as the
        trainer) refuses `misses` times in a row: a dead trainer's broadcast never comes. A trainer
        that sent an NCCL id has no port: NCCL's own error (its sockets close) or the group's
        timeout ends the workers' wait instead (weight_sync/vllm/nccl_comm.py)."""
        host, port = self.info["master_address"], self.info["master_port"]
        if host is None:
            await asyncio.Event().wait()
        missed = 0
        while missed < misses:
            await asyncio.sleep(period_s)
            missed = 0 if await asyncio.to_thread(trainer_reachable, host, port, period_s) else missed + 1

    async def finish(self, weight_version: str | None) -> int:
        if self.staged is None:
            raise TransferError(409, "no update staged: /update_weights first")
        if weight_version is None:
            version = self.manager.version + 1
        elif isinstance(weight_version, str) and weight_version.isdigit():
            version = int(weight_version)
        else:
            raise TransferError(400, f"weight_version: {weight_version!r} is not digits (this sidecar's weight "
                                     "versions are integers that go up; leave it out for the current + 1)")
        if version <= self.manager.version:
            raise TransferError(409, f"weight_version {version} does not go up: this sidecar serves version "
                                     f"{self.manager.version}")
        m, engines, staged = self.staged
        self.staged = None

        async def swap() -> None:
            results = await finish_on_engines(engines, staged, commit=True, timeout=self.timeout_s)
            await commit_results(engines, results, version, "update")
            self.manager.committed(version)

        if self.paused_mode is not None:  # the trainer paused the engines itself
            async with self.manager.state.push_lock:
                await swap()
        else:
            await self.manager.run_paused("keep", swap)
        self.manager.state.count("pushes")
        return version

    async def relabel(self, new_version: str) -> None:
        """vLLM's /update_weight_version names the weights served now anew. Here a version names a
        push's weights (every token carries the one that made it, and peers catch up by it), so it
        changes only with new weights: the current one is accepted as is, any other refused."""
        if new_version != str(self.manager.version):
            raise TransferError(409, f"new_version {new_version!r}: this sidecar's weight versions name the "
                                     f"pushes' weights (version {self.manager.version} is served), so a version "
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
        async with self.manager.state.push_lock:  # never between a push's commit and its version
            try:
                await asyncio.gather(*(e.collective_rpc("zero_weights", timeout=self.timeout_s)
                                       for e in self.manager.up_engines()))
            except ValueError as e:
                raise TransferError(400, f"action 'reset': {e}") from None

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise TransferError(400, f"mode: {mode!r} is not one of {PAUSE_MODES}")
        await asyncio.gather(*(e.pause_generation(mode=mode, clear_cache=False) for e in self.manager.up_engines()))
        self.paused_mode = mode

    async def resume(self) -> None:
        await asyncio.gather(*(e.resume_generation() for e in self.manager.up_engines()))
        self.paused_mode = None

    async def shutdown(self) -> None:
        await self._leave(self.manager.up_engines())

    async def _leave(self, engines: list) -> None:
        """Every engine leaves the trainer's group (a transfer still arriving is given up)."""
        self.staged = None
        if self.info is not None and self.weights.owner and self.weights.owner["group_name"].startswith("vllm:"):
            self.weights.owner = None
        self.info = None
        await asyncio.gather(*(e.collective_rpc("close_vllm_group", timeout=10) for e in engines),
                             return_exceptions=True)
