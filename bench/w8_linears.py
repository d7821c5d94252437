"""Weight-only int8 on a CPU without AMX (engine/kernels/w8_linears.py) against the bf16 engine's own
linears, side by side in one run: a whole model's linears swept in a forward's order (each layer's fused
q/k/v, o, fused gate/up, down, then the lm_head), every layer its own weights, streamed through the caches
as a decode step streams them (bench/amx_linears.py's sweep, on a CPU without tiles).

Ways with AVX512-BF16 (AMD Zen 4 and 5): "bf16 rows" (bf16_rows.c on the weights in place: the bf16
engine's up to 64 sequences), "bf16 oneDNN" (its prepacked op: the bf16 engine's past 64) and "w8" (the
int8 engine's: the int8 copies multiplied as integers on VPDPWSSD, the lm_head on bf16 rows). (The W8A8
scheme the int8 engine ran on such a CPU before is left out: oneDNN's int8 op took 27 s to sweep
Qwen2.5-1.5B's linears at one row on a Zen 4, and it moved 59% of SmolLM2's sampled tokens past
[0.9, 1.1].) On AVX2 alone (AMD Zen 3): "bf16 panels" (the bf16 engine's there: f32_linear.c on the
weights' bf16 panels, widened as loaded, the input widened and the output rounded), "W8A8" (what the int8
engine ran there before: activations quantized per token, torch's int8 matmul) and "w8" (the lm_head on
bf16 panels).
Each figure: ms per sweep, the weights' bytes per second against this CPU's memory read probe, and
GFLOP/s against the matmul probe (bf16's; fp32's on AVX2, where bf16 is multiplied in fp32): where a sweep
is bound, by memory at a few rows, by the products from 16 or so on 2 cores.

    python -m bench.w8_linears --model ~/.cache/rollout-sidecar/shapes/qwen2.5-1.5b-bfloat16-seed0
    python -m bench.w8_linears --rows 1,4,8,32 --repeats 3
"""

from __future__ import annotations

import argparse
import logging

import torch

from bench.amx_linears import _seconds, _tensors, activations, model_linears, read_bandwidth, sweep_of
from bench.engines import probe_peak
from engine.kernels import bf16_rows, derived_weights, f32_linears, huge_pages, int8_linears, w8_linears

log = logging.getLogger("bench.w8_linears")


def sweeps(weights: list[torch.Tensor], huge: bool = True) -> dict:
    """way -> (fn(rows) running every linear once, bytes of weight it streams); the first way is the bf16
    engine's on this CPU."""
    avx512 = bf16_rows.avx512_bf16()
    body = weights[:-1]  # the int8 engine keeps the lm_head in bf16 (int8_linears.KEEP_FULL_PRECISION)
    w8 = [int8_linears.derive(w, ("w8", 127)) for w in body]
    if avx512:
        dnn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        rows = [derived_weights.rows_of(w) for w in weights]
        bf16_copies, w8a8 = [*dnn, *rows], []
    else:  # the bf16 engine's bf16 panels; the per-token scheme the int8 engine ran here before
        panels = [f32_linears.pack(w) for w in weights]
        w8a8_kernel = int8_linears._first_exact(tuple(k for k in int8_linears.KERNELS
                                                      if k[0] not in int8_linears.WEIGHT_ONLY))
        w8a8 = [int8_linears.derive(w, w8a8_kernel) for w in body]
        bf16_copies = panels
    if huge:
        huge_pages.collapse([*weights, *_tensors(bf16_copies), *_tensors(w8), *_tensors(w8a8)])
    lin = torch.nn.Linear(1, 1, bias=False)  # _int8_apply reads nothing of it but the bias it is given
    dense, head = sum(w.numel() for w in weights) * 2, weights[-1].numel() * 2
    x_of = activations(torch.bfloat16)

    def run(apply):
        return sweep_of(weights, x_of, apply)

    def int8(copies, head_way):
        def apply(i, x):
            if i < len(copies):
                int8_linears._int8_apply(lin, x, copies[i], None)
            else:
                head_way(i, x)
        return apply

    if avx512:
        def on_rows(i, x):
            bf16_rows.avx512_linear_rows(x, rows[i])

        def on_dnn(i, x):
            torch.ops.mkldnn._linear_pointwise(x, dnn[i], None, "none", [], "")

        return {"bf16 rows": (run(on_rows), dense), "bf16 oneDNN": (run(on_dnn), dense),
                "w8": (run(int8(w8, on_rows)), sum(c.nbytes for c in w8) + head)}

    def on_panels(i, x):
        f32_linears.linear(x.float(), panels[i]).bfloat16()

    return {"bf16 panels": (run(on_panels), dense), f"W8A8 {w8a8_kernel[0]}": (run(int8(w8a8, on_panels)), None),
            "w8": (run(int8(w8, on_panels)), sum(c.nbytes for c in w8) + head)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or directory (default smollm2)")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256",
                    help="rows per call (a decode step's sequences), comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="sweeps per way, row count and round (the best is kept)")
    ap.add_argument("--no-huge-pages", action="store_true",
                    help="leave the weights on the pages they were allocated on (default: on 2 MB pages, as the "
                         "engine serves them)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not w8_linears.available():
        raise SystemExit("no weight-only int8 kernel on this CPU (it needs AVX2 with FMA): nothing to compare")
    weights = model_linears(args.model)
    params = sum(w.numel() for w in weights)
    probed = "bfloat16" if bf16_rows.avx512_bf16() else "float32"  # what bf16 is multiplied in here
    bandwidth, peak = read_bandwidth(), probe_peak(probed)
    log.info("%s: %d linears, %.0f MB in bf16; memory read probe %.1f GB/s, %s matmul probe %.0f GFLOP/s; "
             "%d threads", args.model, len(weights), params * 2 / 1e6, bandwidth / 1e9, probed, peak / 1e9,
             torch.get_num_threads())
    ways = sweeps(weights, huge=not args.no_huge_pages and huge_pages.enabled())
    with torch.inference_mode():
        for m in map(int, args.rows.split(",")):
            best = {}
            for order in (list(ways), list(ways)[::-1]):  # two rounds in opposite orders: a neighbour hits each alike
                for way in order:
                    fn = ways[way][0]
                    for _ in range(args.repeats):
                        best[way] = min(best.get(way, float("inf")), _seconds(lambda: fn(m)))
            cells = [f"{way} {best[way] * 1e3:.1f} ms ({_read(ways[way][1], best[way], bandwidth)}"
                     f"{2 * m * params / best[way] / 1e9:.0f} GF/s {2 * m * params / best[way] / peak:.0%})"
                     for way in ways]
            log.info("rows %3d: %s | w8 over %s", m, " | ".join(cells),
                     ", ".join(f"{way} {best[way] / best['w8']:.2f}x" for way in ways if way != "w8"))


def _read(nbytes: int | None, seconds: float, bandwidth: float) -> str:
    """The weights' read rate and its share of the probe ('' for a way whose bytes are not counted)."""
    return "" if nbytes is None else f"{nbytes / seconds / 1e9:.1f} GB/s {nbytes / seconds / bandwidth:.0%}, "


if __name__ == "__main__":
    main()
