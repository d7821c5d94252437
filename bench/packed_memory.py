"""What prepacked linears cost in memory (issue 39 item 2): oneDNN and torch's ideep cache one
primitive per distinct row count, so a sidecar's varied batch sizes grow a process. Each way runs a
model's linear shapes at every row count 1..--rows in a fresh process and prints its RSS growth:
`F.linear` (the anchor: MKL, no primitive cache, only the allocator keeping freed outputs), the
engine's packed forward (rows padded to engine/kernels/packed_linears.py's buckets), and oneDNN at the
exact row counts (what the buckets prevent).

    python -m bench.packed_memory                     # the tiny model's shapes, rows 1..600
    python -m bench.packed_memory --model smollm2 --rows 1024
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys

import torch

log = logging.getLogger("bench.packed_memory")
WAYS = ("F.linear", "packed, bucketed", "packed, exact rows")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _shapes(model: str) -> list[tuple[int, int]]:
    from bench.linears import _layers

    return sorted({tuple(w.shape) for w in _layers(model, torch.float32) if w.shape[0] < 10_000})  # no lm_head


def _run_one(way: str, shapes: list[tuple[int, int]], rows: int) -> float:
    """RSS growth (MiB) of this process over rows 1..`rows` on every shape, run `way`."""
    from engine.kernels import packed_linears

    torch.manual_seed(0)
    plain = {s: torch.randn(s) for s in shapes}
    packed = {s: torch.ops.mkldnn._reorder_linear_weight(w) for s, w in plain.items()}
    x = {s: torch.randn(rows, s[1]) for s in shapes}
    run = {"F.linear": lambda a, s: torch.nn.functional.linear(a, plain[s]),
           "packed, bucketed": lambda a, s: packed_linears.blocked_linear(a, packed[s], None),
           "packed, exact rows": lambda a, s: packed_linears._onednn_linear(a, packed[s], None)}[way]
    with torch.inference_mode():
        for s in shapes:
            run(x[s][:1], s)
        start = _rss_mib()
        for m in range(1, rows + 1):
            for s in shapes:
                run(x[s][:m], s)
        return _rss_mib() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a model name or directory whose linear shapes to run")
    ap.add_argument("--rows", type=int, default=600, help="row counts 1..ROWS (default 600)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)  # the child process's way
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = _shapes(args.model)
    if args.one:
        print(json.dumps(_run_one(args.one, shapes, args.rows)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("%s: %d linear shapes %s, row counts 1..%d, each way in a process of its own", args.model,
             len(shapes), shapes, args.rows)
    grown = {}
    for way in WAYS:
        out = subprocess.run([sys.executable, "-m", "bench.packed_memory", "--model", args.model, "--rows",
                              str(args.rows), "--threads", str(args.threads), "--one", way],
                             capture_output=True, text=True, check=True)
        grown[way] = json.loads(out.stdout.strip().splitlines()[-1])
        log.info("%-20s RSS grew %7.1f MiB", way, grown[way])
    log.info("bucketed / F.linear: %+.1f MiB; exact rows / bucketed: %.1fx", grown["packed, bucketed"] - grown["F.linear"],
             grown["packed, exact rows"] / max(grown["packed, bucketed"], 1e-9))


if __name__ == "__main__":
    main()
