"""Delta pushes against full pushes (issue 38): a real GRPO run (recipes.grpo on arithmetic, at its
learning rate for real models, 1e-5; the tiny model on its toy task) into a sidecar serving bf16, once with `--delta on` and once with `--delta off`
from the same seed, on loopback and over a shaped link (the hosts test bed: the sidecar on a host
whose link runs at --rate-mbit). Read from each run's metrics, per step: the bytes on the wire and
the push time (timing/weight_sync: the trainer's whole push_weights, encode included).

Printed per link: the medians over steps 2..N (step 1 is AdamW's first, which moves far more
elements) and step 1 apart, delta against full (goals over the link: >= 10x fewer bytes, >= 5x less
push time); the trainer's encode and the engine's apply (ms) against the transfer time they save;
and the full push against the link bound (its bytes at the nominal rate).

    python -m bench.delta                                   # SmolLM2, loopback and 100 Mbit/s, 5 steps
    python -m bench.delta --model tiny --steps 3 --no-link  # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("bench.delta")
TOKEN = "bench-delta"
GOAL_BYTES, GOAL_TIME = 10.0, 5.0
RUN = ["--prompts-per-step", "2", "--group-size", "4", "--max-tokens", "32", "--seed", "0", "--log-level", "WARNING",
       "--log-completions", "0"]


def recipe(model: str, steps: int, delta: str, out: Path, extra: list[str], popen=subprocess.Popen) -> list[dict]:
    """One GRPO run; its metrics, a dict per step."""
    argv = [sys.executable, "-m", "recipes.grpo", "--model", model, "--max-steps", str(steps), "--delta", delta,
            "--output-dir", str(out), *RUN, *extra]
    proc = popen(argv, env={**os.environ, "PYTHONPATH": os.getcwd(), "WANDB_MODE": "offline"})
    if proc.wait(timeout=3600) != 0:
        raise RuntimeError(f"the GRPO run (--delta {delta}) exited with code {proc.returncode}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    later = rows[1:] or rows
    med = lambda key: statistics.median(r.get(key, 0.0) for r in later)  # noqa: E731
    return {"bytes": med("weight_sync/bytes"), "full_bytes": rows[0]["weight_sync/full_bytes"],
            "seconds": med("timing/weight_sync"), "encode_s": med("weight_sync/encode_seconds"),
            "apply_s": med("weight_sync/apply_seconds"), "deltas": sum(r["weight_sync/delta"] for r in rows),
            "step1_bytes": rows[0]["weight_sync/bytes"], "step1_seconds": rows[0]["timing/weight_sync"]}


def report(link: str, on: dict, off: dict, rate_mbit: float | None) -> dict:
    bound = off["full_bytes"] * 8 / (rate_mbit * 1e6) if rate_mbit else None
    row = {"link": link, "delta_bytes": on["bytes"], "full_bytes": off["bytes"], "bytes_ratio": off["bytes"] / max(on["bytes"], 1),
           "delta_s": on["seconds"], "full_s": off["seconds"], "time_ratio": off["seconds"] / on["seconds"],
           "encode_ms": on["encode_s"] * 1e3, "apply_ms": on["apply_s"] * 1e3, "deltas": on["deltas"],
           "step1_delta_bytes": on["step1_bytes"], "step1_delta_s": on["step1_seconds"], "link_bound_s": bound}
    print(f"\n{link}: steps 2..N, median (step 1: delta {on['step1_bytes'] / 1e6:.1f} MB in {on['step1_seconds']:.2f} s)")
    print(f"  bytes      delta {on['bytes'] / 1e6:8.2f} MB   full {off['bytes'] / 1e6:8.2f} MB   "
          f"{row['bytes_ratio']:6.1f}x fewer (goal {GOAL_BYTES:g}x)")
    print(f"  push time  delta {on['seconds']:8.2f} s    full {off['seconds']:8.2f} s    "
          f"{row['time_ratio']:6.1f}x less{f' (goal {GOAL_TIME:g}x)' if rate_mbit else ''}")
    print(f"  trainer encode {row['encode_ms']:.0f} ms, engine apply {row['apply_ms']:.0f} ms, against "
          f"{off['seconds'] - on['seconds']:.2f} s of push time saved")
    if bound:
        print(f"  full push {off['seconds']:.2f} s against the link bound {bound:.2f} s ({bound / off['seconds']:.2f} "
              f"of it); delta {on['bytes'] * 8 / (rate_mbit * 1e6):.2f} s of bytes at the nominal rate")
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model name (tiny, small, smollm2, ...) or directory")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps per run (each ends with a push)")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="the sidecar host's link, each direction")
    p.add_argument("--no-link", dest="link", action="store_false", help="loopback only (no test bed: needs root)")
    p.add_argument("--no-loopback", dest="loopback", action="store_false", help="over the shaped link only")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.models.model_names import resolve_model_arg

    model = resolve_model_arg(args.model)
    if args.model != "tiny":  # a pretrained model: the task (and learning rate, 1e-5) the recipes fine-tune it on
        RUN.extend(["--task", "arithmetic"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        if args.loopback:
            runs = {d: summary(recipe(model, args.steps, d, Path(tmp) / f"lo-{d}", ["--sidecar-dtype", "bfloat16"]))
                    for d in ("on", "off")}
            rows.append(report("loopback", runs["on"], runs["off"], None))
        if args.link:
            rows.append(over_link(model, args, Path(tmp)))
    print(json.dumps(rows))


def over_link(model: str, args, tmp: Path) -> dict:
    from bench.hostbed import HostBed, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"error: {why} (or --no-link)")
    runs = {}
    with HostBed(["h1"], rate_mbit=args.rate_mbit) as bed:
        for d in ("on", "off"):  # a fresh sidecar for each run: each starts from version 0
            side = bed.sidecar("h1", model, "--dtype", "bfloat16", "--log-level", "WARNING", "--max-model-len", "1024",
                               "--stats-interval", "0", "--warm-standby", "off", "--host-copy", "off", token=TOKEN)
            try:
                runs[d] = summary(recipe(model, args.steps, d, tmp / f"link-{d}",
                                         ["--rollout-url", side.url, "--token", TOKEN]))
            finally:
                side.stop()
    return report(f"{args.rate_mbit:g} Mbit/s link", runs["on"], runs["off"], args.rate_mbit)


if __name__ == "__main__":
    main()
