"""Metrics: a JSONL file, optional wandb (offline unless credentials are configured), and a
reward-curve PNG at the end."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class Tracker:
    def __init__(self, output_dir: Path, report_to: str, run_name: str, config: dict, enabled: bool = True):
        """`enabled=False` (ranks other than 0): keep the rows in memory, write nothing."""
        self.output_dir = output_dir
        self.run_name = run_name
        self.path = output_dir / "metrics.jsonl"
        self.enabled = enabled
        if enabled:
            self.path.write_text("")
            (output_dir / "completions.jsonl").unlink(missing_ok=True)
        self.rows: list[dict] = []
        self.run = None
        if report_to not in ("wandb", "none"):
            raise ValueError(f"--report-to must be 'wandb' or 'none', got {report_to!r}")
        if report_to == "wandb" and enabled:
            import wandb

            if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
                os.environ["WANDB_MODE"] = "offline"  # no credentials: keep the run on disk
            self.run = wandb.init(project="rollout-sidecar", name=run_name, config=config,
                                  dir=str(output_dir))

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **metrics}
        self.rows.append(row)
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """Sampled completions (prompt, text, token ids, reward) to completions.jsonl, to read
        what the policy says as it learns."""
        if not self.enabled or not rows:
            return
        with (self.output_dir / "completions.jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def finish(self) -> Path | None:
        if not self.enabled:
            return None
        png = self.plot_reward()
        if self.run is not None:
            self.run.finish()
        return png

    # shares an agent run logs beside its reward (recipes.agent): drawn when a run has them, not all 0
    MORE_CURVES = ("env/correct", "episodes/called_well")

    def _more_curves(self) -> list[str]:
        return [n for n in self.MORE_CURVES if any(r.get(n) for r in self.rows)]

    def plot_reward(self) -> Path | None:
        if not self.rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.rows]
        reward = [r["reward"] for r in self.rows]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, reward, label="reward", alpha=0.5)
        k = max(1, len(reward) // 10)
        smooth = [sum(reward[max(0, i - k + 1): i + 1]) / len(reward[max(0, i - k + 1): i + 1])
                  for i in range(len(reward))]
        ax.plot(steps, smooth, label=f"mean of last {k}")
        more = self._more_curves()
        for name in more:
            ax.plot(steps, [r.get(name, 0.0) for r in self.rows], label=name, alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("reward, share of episodes" if more else "reward")
        ax.set_title(f"{self.run_name}: reward per step")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        out = self.output_dir / "reward_curve.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out
