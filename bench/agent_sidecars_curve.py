"""`recipes.agent` on one sidecar and on N through the router, the same seed, one figure (issue 66): the
reward per step of each, and each run's prefix-cache hit rate and wall time. Over N sidecars the
episodes run through `python -m rollout.router` (`--transport openai`), as an OpenAI-style environment
would; on one, through the sidecar's own front.

    python -m bench.agent_sidecars_curve                    # letter game, tiny model, 40 steps, N = 2
    python -m bench.agent_sidecars_curve --steps 8 --out /tmp/curve.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("bench.agent_sidecars_curve")


def run_one(sidecars: int, steps: int, out: Path, seed: int) -> tuple[list[dict], float]:
    from recipes import agent

    t0 = time.perf_counter()
    agent.main(["--transport", "openai", "--sidecars", str(sidecars), "--max-steps", str(steps), "--seed", str(seed),
                "--output-dir", str(out), "--log-level", "WARNING"])
    (out / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return load(out)


def load(out: Path) -> tuple[list[dict], float]:
    """A finished run's rows and wall seconds (--replot)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, float((out / "wall_s.txt").read_text())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.agent_sidecars_curve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sidecars", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="out/agent_sidecars_curve")
    p.add_argument("--out", default="docs/agent_router_vs_one.png")
    p.add_argument("--replot", action="store_true", help="draw the figure again from --work-dir's runs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # N sidecars' engines and the trainer over few cores: OpenMP's spinning barriers would time the
    # neighbours (the sidecars inherit it)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    runs = {}
    for n in (1, args.sidecars):
        out = Path(args.work_dir) / f"sidecars{n}"
        runs[n] = load(out) if args.replot else run_one(n, args.steps, out, args.seed)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, (rows, wall) in runs.items():
        label = "one sidecar" if n == 1 else f"{n} sidecars through rollout.router"
        style = {"linewidth": 4, "alpha": 0.5} if n == 1 else {"linestyle": "--"}  # they may coincide: seeded
        ax.plot([r["step"] for r in rows], [r["reward"] for r in rows], label=f"{label} ({wall / 60:.1f} min)", **style)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"recipes.agent, letter game, seed {args.seed}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    k = max(1, min(10, args.steps // 2))
    for n, (rows, wall) in runs.items():
        first = sum(r["reward"] for r in rows[:k]) / k
        last = sum(r["reward"] for r in rows[-k:]) / k
        hits = sum(r.get("prefix_cache/hit_rate", 0.0) for r in rows) / len(rows)
        moves = rows[-1].get("routing/moves", 0)
        print(f"{n} sidecar(s): reward first {k} steps {first:.3f} -> last {k} {last:.3f}; mean prefix hit rate "
              f"{hits:.1%}; moves {moves}; {wall:.0f} s")
    same = [a["reward"] == b["reward"] for a, b in zip(*(rows for rows, _ in runs.values()))]
    print(f"steps with the same reward bit for bit: {sum(same)} of {len(same)} (requests are seeded and the engine is "
          "batch invariant: where an episode runs changes no token)")
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
