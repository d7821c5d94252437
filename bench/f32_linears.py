"""The fp32 engine's linears on our kernel (engine/kernels/f32_linears.py) against oneDNN's prepacked op
(what the engine ran before, and still runs without AVX-512) and torch's `F.linear` (MKL), side by
side in one run: a whole model's linears swept in a forward's order (each layer's fused q/k/v, o,
fused gate/up, down, then the lm_head), every layer its own weights, as a decode step streams them.

Each figure: ms per sweep and GFLOP/s, against this CPU's fp32 matmul probe (bench.engines'
probe_peak: how far from the machine's limit) and the weights' bytes per second against the memory
read probe (at 32 rows a sweep streams 538 MB of SmolLM2's weights as much as it computes).

`--dtype bfloat16`: a bf16 model's linears on a CPU without bf16 kernels (AVX2), each input widened and
each output rounded to bf16: ours on bf16 panels (the engine's copy there, widened as the kernel loads
it), ours on the bf16 weights in place (`ROLLOUT_F32_IN_PLACE=1`: no copy), ours on an fp32 copy (the
engine's before) and oneDNN's op on an fp32 copy (before ours).

    python -m bench.f32_linears                  # SmolLM2-135M, rows 1,32,256
    python -m bench.f32_linears --rows 32 --repeats 20
    python -m bench.f32_linears --dtype bfloat16 --model ~/.cache/rollout-sidecar/shapes/qwen2.5-1.5b-bfloat16-seed0
"""

from __future__ import annotations

import argparse
import logging

import torch

from bench.amx_linears import _seconds, activations, model_linears, read_bandwidth, sweep_of
from bench.engines import probe_peak
from engine.kernels import derived_weights, f32_linears

log = logging.getLogger("bench.f32_linears")


def sweeps(weights: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> dict:
    """way -> (fn(rows) running every linear once, bytes of weight it reads); the first way is the engine's."""
    wide = [w.float() for w in weights]
    dnn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in wide]
    ours = [f32_linears.pack(w) for w in wide]
    x_of = activations(dtype)
    count = sum(w.numel() for w in weights)

    def run(apply):  # the input widened and the output rounded in bf16 (no-ops in fp32)
        return sweep_of(weights, x_of, lambda i, x: apply(i, x.float()).to(dtype))

    ways = {"ours": (run(lambda i, x: f32_linears.linear(x, ours[i])), 4 * count),
            "oneDNN packed": (run(lambda i, x: torch.ops.mkldnn._linear_pointwise(x, dnn[i], None, "none", [], "")),
                              4 * count)}
    if dtype == torch.bfloat16:  # no F.linear (its fp32 weights: memory a 1B shape's four copies lack)
        panels, rows = [f32_linears.pack(w) for w in weights], [derived_weights.rows_of(w) for w in weights]
        return {"ours bf16 panels": (run(lambda i, x: f32_linears.linear(x, panels[i])), 2 * count),
                "ours bf16 in place": (run(lambda i, x: f32_linears.linear_rows(x, rows[i])), 2 * count),
                "ours fp32 copy": ways["ours"], "oneDNN packed": ways["oneDNN packed"]}
    return {**ways, "F.linear (MKL)": (run(lambda i, x: torch.nn.functional.linear(x, wide[i])), 4 * count)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or directory (default smollm2)")
    ap.add_argument("--rows", default="1,32,256", help="rows per call (a decode step's sequences), comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="sweeps per way, row count and round (the best is kept)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the model's dtype (bfloat16: its linears multiplied in fp32, as on AVX2)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not f32_linears.available():
        raise SystemExit("the fp32 kernel does not serve here (no AVX-512, or ROLLOUT_F32_KERNEL=0): "
                         "nothing to compare")
    weights = [w.to(dtype) for w in model_linears(args.model)]
    params = sum(w.numel() for w in weights)
    bandwidth, peak = read_bandwidth(), probe_peak("float32")
    log.info("%s: %d linears, %.0f MB in %s; fp32 matmul probe %.1f GFLOP/s, memory read probe %.1f GB/s; %d threads",
             args.model, len(weights), params * weights[0].element_size() / 1e6, args.dtype, peak / 1e9,
             bandwidth / 1e9, torch.get_num_threads())
    ways = sweeps(weights, dtype)
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            best = {}
            for order in (list(ways), list(ways)[::-1]):  # two rounds in opposite orders: a neighbour hits each alike
                for way in order:
                    for _ in range(args.repeats):
                        best[way] = min(best.get(way, float("inf")), _seconds(lambda: ways[way][0](rows)))
            best = {way: best[way] for way in ways}
            cells = [f"{way} {t * 1e3:.2f} ms ({2 * rows * params / t / 1e9:.0f} GFLOP/s = "
                     f"{2 * rows * params / t / peak:.0%} of the probe, {ways[way][1] / t / bandwidth:.0%} of the read "
                     "probe)" for way, t in best.items()]
            first, *others = ways
            log.info("rows %3d: %s | %s", rows, " | ".join(cells),
                     ", ".join(f"{first} / {way} {best[way] / best[first]:.2f}x" for way in others))


if __name__ == "__main__":
    main()
