"""GRPO with `--on-policy exact` against the same run corrected by truncated importance sampling (issue 65's
must-show): SmolLM2 on arithmetic, a bf16 sidecar, each seed run once per mode (one run at a time), then the
correctness and the mismatch of every run side by side and one figure of both curves.

    python -m bench.on_policy_runs                          # seeds 0-2, 30 steps each (8-12 min a run on 2 cores)
    python -m bench.on_policy_runs --seeds 0 --steps 5      # quicker
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("bench.on_policy_runs")

MODES = {"exact": ["--on-policy", "exact"], "tis": ["--is-mode", "token_truncate"]}


def run(mode: str, seed: int, args) -> list[dict]:
    out = Path(args.output_dir) / f"{mode}-{seed}"
    if args.replot:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cmd = [sys.executable, "-m", "recipes.grpo", "--model", args.model, "--task", "arithmetic", "--max-steps",
           str(args.steps), "--sidecar-dtype", "bfloat16", "--seed", str(seed), "--output-dir", str(out),
           "--log-level", "WARNING", *MODES[mode]]
    log.info("%s", " ".join(cmd[1:]))
    subprocess.run(cmd, check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def ends(rows: list[dict], key: str, k: int = 10) -> tuple[float, float]:
    k = max(1, min(k, len(rows) // 2))
    return sum(r[key] for r in rows[:k]) / k, sum(r[key] for r in rows[-k:]) / k


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for (mode, seed), rows in runs.items():
        style = {"color": "tab:green" if mode == "exact" else "tab:orange", "alpha": 0.8,
                 "linestyle": ("-", "--", ":", "-.")[seed % 4], "label": f"{mode}, seed {seed}"}
        steps = [r["weight_version"] for r in rows]
        top.plot(steps, [r["reward/correct"] for r in rows], **style)
        bottom.plot(steps, [100 * r["mismatch/outside_band"] for r in rows], **style)
    top.set_ylabel("correct (share of samples)")
    bottom.set_ylabel("% tokens outside [0.9, 1.1]")
    bottom.set_xlabel("step")
    top.legend(fontsize=7, ncol=2)
    top.set_title("SmolLM2-135M GRPO on arithmetic, bf16 sidecar: --on-policy exact vs TIS")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--output-dir", default="out/on_policy_runs")
    ap.add_argument("--figure", default=None, help="where the curves go (default: in --output-dir)")
    ap.add_argument("--replot", action="store_true", help="no runs: the table and figure of the runs in --output-dir")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs = {(mode, int(seed)): run(mode, int(seed), args) for seed in args.seeds.split(",") for mode in MODES}
    log.info("%-6s %4s %24s %28s %14s", "mode", "seed", "correct, first -> last 10", "outside [0.9,1.1], first -> last",
             "max |log r|")
    for (mode, seed), rows in runs.items():
        c0, c1 = ends(rows, "reward/correct")
        m0, m1 = ends(rows, "mismatch/outside_band")
        worst = max(r["sampling/sampling_logp_difference/max"] for r in rows)
        log.info("%-6s %4d %24s %28s %14.3f", mode, seed, f"{c0:.3f} -> {c1:.3f}",
                 f"{100 * m0:.2f}% -> {100 * m1:.2f}%", worst)
    figure = Path(args.figure or Path(args.output_dir) / "exact_vs_tis.png")
    plot(runs, figure)
    log.info("curves: %s", figure)


if __name__ == "__main__":
    main()
