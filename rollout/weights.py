"""The sidecar's side of weight sync: join the trainer's group, and run each push as
pause -> receive -> commit -> resume across every engine (weight_sync does the transfer)."""

from __future__ import annotations

import asyncio
import asyncio
import logging
import time

from weight_sync.engine_sync import (
    close_weight_sync, commit_results, join_engines, load_on_engines, receive_on_engines,
)
from weight_sync.manifest import Manifest

log = logging.getLogger(__name__)


class SidecarWeights:
    def __init__(self, manager):
        self.manager = manager

    async def init(self, host: str, port: int, world_size: int, rank_offset: int, group_name: str,
                   timeout_s: float, secret: str) -> dict:
        info = {"host": host, "port": port, "world_size": world_size, "group_name": group_name,
                "timeout_s": timeout_s, "secret": secret}
        engines = self.manager.engines
        await join_engines(engines, info, rank_offset, timeout=timeout_s + 30)
        log.info("joined weight-sync group %s as ranks %d..%d of %d", group_name, rank_offset,
                 rank_offset + len(engines) - 1, world_size)
        return {"ranks": list(range(rank_offset, rank_offset + len(engines)))}

    async def push(self, manifest_wire: dict, pause_mode: str | None, timeout_s: float, on_paused=None,
                   group_name: str | None = None, shared: dict | None = None) -> dict:
        """Over the group, or (`shared`: a weight_sync.shared handle) from memory on this machine."""
        manifest = Manifest.from_wire(manifest_wire)  # a malformed manifest fails here, before any pause
        m = self.manager
        t0 = time.monotonic()

        async def receive() -> list:
            if not shared:
                return await receive_on_engines(m.engines, manifest, timeout_s, group_name)
            calls = [e.collective_rpc("receive_weights_shared", timeout=timeout_s, args=(manifest_wire, shared))
                     for e in m.engines]
            return await asyncio.gather(*calls, return_exceptions=True)

        async def work():
            t1 = time.monotonic()
            results = await receive()
            transfer = time.monotonic() - t1
            try:
                out = await commit_results(m.engines, results, manifest.version, "push")
            except Exception:
                m.counters["failed_pushes"] += 1
                raise
            m.version = manifest.version
            m.counters["transfer_seconds"] += transfer
            return {**out, "transfer_seconds": transfer}

        out = await m.run_paused(pause_mode, work, on_paused)
        m.counters["pushes"] += 1
        m.counters["push_seconds"] += time.monotonic() - t0
        out.pop("worker_results", None)
        return {**out, "seconds": time.monotonic() - t0}

    async def load(self, path: str, version: int, pause_mode: str | None) -> dict:
        m = self.manager

        async def work():
            out = await load_on_engines(m.engines, path, version)
            m.version = version
            return out

        out = await m.run_paused(pause_mode, work)
        out.pop("worker_results", None)
        m.counters["pushes"] += 1
        return out

    async def close(self) -> None:
        await close_weight_sync(self.manager.engines)
