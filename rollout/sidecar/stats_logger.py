"""Logs the sidecar's counters every few seconds, and to wandb when a project is given."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("rollout.stats")


class StatsLogger:
    def __init__(self, manager, interval_s: float, wandb_project: str | None = None):
        self.manager = manager
        self.interval_s = interval_s
        self.wandb_project = wandb_project
        self._task: asyncio.Task | None = None
        self._run = None

    def start(self) -> None:
        if self.wandb_project:
            import wandb

            self._run = wandb.init(project=self.wandb_project, job_type="rollout-sidecar")
        if self.interval_s > 0:
            self._task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            s = self.manager.stats()
            log.info(
                "version %d | %.0f tok/s | %d in flight | %d rollouts | %d pushes (%.2fs) | paused %.2fs | "
                "%d resubmitted | %d stale restarts",
                s["version"], s["tokens_per_s"], s["queue_depth"], s["rollouts"], s["pushes"], s["push_seconds"],
                s["pause_seconds"], s["aborted_resubmitted"], s["stale_restarts"],
            )
            if self._run is not None:
                self._run.log({f"sidecar/{k}": v for k, v in s.items() if isinstance(v, (int, float))})

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._run is not None:
            self._run.finish()
