"""A mixture of experts' expert GEMMs on this CPU, the engine's way against the others, side by side in
one run: every sparse layer's gate/up then down GEMM over a step's picks, each layer its own experts (a
decode step streams them all from memory), at a given number of rows an expert (a 32-sequence step of a
top-4-of-32 model: ~4; a 256-sequence one: ~32).

Ways, each the GEMMs alone (no routing, silu or sum: the same inputs for all):
  panels      f32_linear.c's panel groups on a copy of every expert's weights as the dense linears'
              panels (bf16 kept bf16, widened as loaded): the engine's way on AVX2 (moe_experts.panels)
  in place    moe_experts.c's dot products on the weights as a trainer holds them: the engine's way
              before, and with ROLLOUT_EXPERT_PANELS=0
  grouped_mm  torch's grouped GEMM, transformers' default experts forward (moe_experts.grouped_linear):
              what a model on transformers' layers runs

Each figure: ms a sweep, GFLOP/s against this CPU's fp32 matmul probe (bench.engines' probe_peak: the
products run in fp32 in every dtype here) and the weights' bytes a second against the memory read probe.

    python -m bench.expert_gemms --model ~/.cache/rollout-sidecar/shapes/qwen3-moe-2core-bfloat16-seed0
    python -m bench.expert_gemms --model <dir> --dtype float32 --rows 1,4,8,32 --layers 8
"""

from __future__ import annotations

import argparse
import ctypes
import logging

import torch

from bench.amx_linears import _seconds, read_bandwidth
from bench.engines import probe_peak
from engine.kernels import f32_linears, moe_experts, native_kernels
from engine.models import llama_model, moe_model

log = logging.getLogger("bench.expert_gemms")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_IN_PLACE = {torch.bfloat16: "bf16_dot_groups", torch.float32: "f32_dot_groups"}


def _kernel(library: str, symbol: str):
    fn = native_kernels.function(library, symbol, (_P, _I, _P, _P, _I, _P, _I, _P), ctypes.c_int)
    if fn is None:
        raise SystemExit(f"{library}.c's {symbol} does not build here")
    return fn


def ways(layers: list, dtype: torch.dtype) -> dict:
    """way -> fn(x, act, starts, experts, outs) running every layer's two GEMMs once and returning the last
    layer's outputs; the first is the engine's way on AVX2. `layers`: [(gate_up [E, 2I, H], down [E, H, I])];
    starts [E + 1]: where each expert's rows start (every expert's in order); outs: buffers for the outputs."""
    panels = [tuple(moe_experts._pack_experts(w).packed for w in layer) for layer in layers]
    grouped, in_place = _kernel("f32_linear", moe_experts._PANEL_GROUPS[dtype]), _kernel("moe_experts", _IN_PLACE[dtype])

    def native(fn, weights):
        def sweep(x, act, starts, experts, outs):
            for gate_up, down in weights:
                for rows, w, out in ((x, gate_up, outs[0]), (act, down, outs[1])):
                    n = out.shape[1]
                    if fn(rows.data_ptr(), rows.shape[1], starts.data_ptr(), experts.data_ptr(), experts.numel(),
                          w.data_ptr(), n, out.data_ptr()):
                        raise MemoryError("an expert GEMM ran out of memory")
            return outs
        return sweep

    def torch_grouped(x, act, starts, experts, outs):
        ends = starts[1:].to(torch.int32)
        for gate_up, down in layers:
            out = moe_experts.grouped_linear(x, gate_up, ends), moe_experts.grouped_linear(act, down, ends)
        return out

    return {"panels": native(grouped, panels), "in place": native(in_place, layers), "grouped_mm": torch_grouped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a mixture of experts' directory (bench.model_shapes builds them)")
    ap.add_argument("--rows", default="1,4,32", help="rows an expert, comma-separated")
    ap.add_argument("--layers", type=int, default=0, help="sparse layers to sweep (default: the model's)")
    ap.add_argument("--repeats", type=int, default=5, help="sweeps per way, row count and round (the best is kept)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not f32_linears.available():
        raise SystemExit("the fp32 kernel does not serve here (no AVX-512 or AVX2, or ROLLOUT_F32_KERNEL=0)")
    dtype = getattr(torch, args.dtype)
    cfg = llama_model.read_config(args.model)
    moe = moe_model.moe_fields(cfg)
    count = args.layers or sum(moe.sparse)
    e, h, i = moe.experts, cfg.hidden_size, moe.intermediate
    g = torch.Generator().manual_seed(0)
    layers = [((torch.randn(e, 2 * i, h, generator=g) * 0.02).to(dtype), (torch.randn(e, h, i, generator=g) * 0.02).to(dtype))
              for _ in range(count)]
    nbytes = count * 3 * e * i * h * layers[0][0].element_size()
    bandwidth, peak = read_bandwidth(), probe_peak("float32")
    log.info("%s: %d sparse layers of %d experts (%d x %d, %d x %d), %.2f GB in %s; fp32 matmul probe %.1f GFLOP/s, "
             "memory read probe %.1f GB/s; %d threads", args.model, count, e, 2 * i, h, h, i, nbytes / 1e9, args.dtype,
             peak / 1e9, bandwidth / 1e9, torch.get_num_threads())
    sweeps = ways(layers, dtype)
    experts = torch.arange(e, dtype=torch.int64)
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            starts = torch.arange(0, e * rows + 1, rows, dtype=torch.int64)
            x, act = torch.randn(e * rows, h, generator=g).to(dtype), torch.randn(e * rows, i, generator=g).to(dtype)
            outs = (torch.empty(e * rows, 2 * i, dtype=dtype), torch.empty(e * rows, h, dtype=dtype))
            best = {}
            for order in (list(sweeps), list(sweeps)[::-1]):  # two rounds in opposite orders
                for way in order:
                    for _ in range(args.repeats):
                        best[way] = min(best.get(way, float("inf")),
                                        _seconds(lambda: sweeps[way](x, act, starts, experts, outs)))
            flops = 2 * e * rows * 3 * i * h * count
            cells = [f"{way} {best[way] * 1e3:.1f} ms ({flops / best[way] / 1e9:.0f} GFLOP/s = "
                     f"{flops / best[way] / peak:.0%} of the probe, {nbytes / best[way] / bandwidth:.0%} of the read "
                     "probe)" for way in sweeps]
            first, *others = sweeps
            log.info("%3d rows an expert: %s | %s", rows, " | ".join(cells),
                     ", ".join(f"{first} / {way} {best[way] / best[first]:.2f}x" for way in others))


if __name__ == "__main__":
    main()
