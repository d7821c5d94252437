"""Which int8 linear the CPU engine should run (issue 49 item 4), chosen by measuring: one model's
linear shapes (SmolLM2-135M's by default, read from its directory) at a decode step's and a
prefill's row counts, every way torch 2.13 offers, against the prepacked fp32 and bf16 linears the
engine runs today (engine/kernels/packed_linears.py). Each int8 way's time includes quantizing its
activations (and rescaling its output): what a forward pays.

    (a) int_mm       dynamic per-token int8 activations, torch._int_mm (int8 x int8 -> int32),
                     per-output-channel weight scales applied to the int32 product
    (b) w8 fp32/bf16 weight-only int8: torch._weight_int8pack_mm, activations fp32 or bf16
    (c) onednn tok   torch.ops.onednn.qlinear_pointwise on a qlinear_prepack'ed int8 weight, the
                     activations quantized per token (the op takes one activation scale: 1, and the
                     per-token scales multiply its fp32 output)
        onednn ten   the same, one dynamic scale for the whole activation (what the op is made for)
    (d) fbgemm       torch.ops.quantized.linear_dynamic (per-tensor dynamic activations, x86 engine)
    engine int8      what the engine runs (engine/kernels/int8_linears.py: the kernel its probe chose,
                     per-token activations, rows padded to packed_linears' buckets), fp32 or bf16 in

Each figure: the model's linears summed (each shape times its count), GFLOP/s, and the ratios
against packed bf16 and fp32; `err` is max|out - ref| / max|ref| against the fp32 product of the
fp32 weight (the worst shape), on activations shaped like a decoder's (a few outlier channels).
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` runs the same kernels as an AVX2-only CPU would.

    python -m bench.int8_linears                       # smollm2, rows 1,8,32,64,256
    python -m bench.int8_linears --rows 32 --min-seconds 0.2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections import Counter

import torch

from engine.kernels import int8_linears
from engine.kernels.int8_linears import quantize_rows

log = logging.getLogger("bench.int8_linears")


def _time(fn, min_seconds: float, blocks: int = 5) -> float:
    """Seconds per call: the best of `blocks` blocks of calls, each at least min_seconds / blocks
    (on a CPU shared with other jobs, the best block is the one least disturbed)."""
    start = time.perf_counter()
    fn()
    if (first := time.perf_counter() - start) > min_seconds:  # a way too slow to matter: timed once
        return first
    best = float("inf")
    for _ in range(blocks):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_seconds / blocks or reps < 2:
            fn()
            reps += 1
        best = min(best, elapsed / reps)
    return best


def linear_shapes(model_dir: str) -> Counter:
    """(out_features, in_features) -> how many linears of that shape, from the model's config.json
    (a Llama-shaped decoder: q, k, v, o, gate, up, down per layer, and the lm_head)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c.get("num_key_value_heads", c["num_attention_heads"]) * d
    shapes = Counter({(q, h): layers, (h, q): layers, (i, h): 2 * layers, (h, i): layers})
    shapes[(kv, h)] += 2 * layers
    shapes[(c["vocab_size"], h)] += 1
    return shapes


def real_weights(model_dir: str, shapes) -> dict:
    """One real weight per shape (layer 0's, and the embedding for the lm_head), in fp32."""
    from safetensors import safe_open

    found = {}
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            if (".layers.0." in name or "embed_tokens" in name or name.startswith("lm_head")) and name.endswith("weight"):
                t = f.get_tensor(name)
                if t.dim() == 2 and tuple(t.shape) in shapes and tuple(t.shape) not in found:
                    found[tuple(t.shape)] = t.float()
    for s in shapes:
        found.setdefault(s, torch.randn(s) * 0.05)
    return found


def activations(rows: int, k: int) -> torch.Tensor:
    """A decoder's hidden states, roughly: normal, with a few channels 20x larger (the outliers that
    make per-tensor activation scales lose the rest)."""
    x = torch.randn(rows, k)
    x[:, :: max(1, k // 4)] *= 20
    return x


def _ways(w: torch.Tensor) -> dict:
    """name -> (fn(x fp32) -> out, input dtype) for one weight; the weight work done here, once."""
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    wq = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    ways = {}
    p32 = torch.ops.mkldnn._reorder_linear_weight(w)
    ways["fp32 packed"] = (lambda x: torch.ops.mkldnn._linear_pointwise(x, p32, None, "none", [], ""), torch.float32)
    try:
        p16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16())
        ways["bf16 packed"] = (lambda x: torch.ops.mkldnn._linear_pointwise(x, p16, None, "none", [], ""), torch.bfloat16)
    except RuntimeError:
        pass
    wq_t = wq.t()

    def int_mm(x):
        q, s = quantize_rows(x)
        return torch._int_mm(q, wq_t) * (s * scale)

    ways["(a) int_mm"] = (int_mm, torch.float32)
    # what the engine runs (engine/kernels/int8_linears.py): its kernel, rows padded to buckets
    for dtype in (torch.float32, torch.bfloat16):
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype).requires_grad_(False)
        layer.weight.copy_(w)
        int8_linears.install(torch.nn.Sequential(layer))
        ways[f"engine int8 {'bf16' if dtype == torch.bfloat16 else 'fp32'}"] = (layer, dtype)
    ways["(b) w8 fp32"] = (lambda x: torch._weight_int8pack_mm(x, wq, scale), torch.float32)
    scale16 = scale.bfloat16()
    ways["(b) w8 bf16"] = (lambda x: torch._weight_int8pack_mm(x, wq, scale16), torch.bfloat16)
    try:
        pq = torch.ops.onednn.qlinear_prepack(wq, None)
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        qlinear = torch.ops.onednn.qlinear_pointwise

        def onednn_token(x):
            q, s = quantize_rows(x)
            return qlinear(q, 1.0, 0, pq, scale, zeros, None, 1.0, 0, torch.float32, "none", [], "") * s

        def onednn_tensor(x):
            s = x.abs().amax().item() / 127
            q = torch.round(x / s).clamp(-127, 127).to(torch.int8)
            return qlinear(q, s, 0, pq, scale, zeros, None, 1.0, 0, torch.float32, "none", [], "")

        ways["(c) onednn tok"] = (onednn_token, torch.float32)
        ways["(c) onednn ten"] = (onednn_tensor, torch.float32)
    except (RuntimeError, AttributeError) as e:
        log.info("oneDNN qlinear unavailable: %s", str(e).splitlines()[0])
    try:
        torch.backends.quantized.engine = "x86"
        wqq = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(wqq, None)
        ways["(d) fbgemm"] = (lambda x: torch.ops.quantized.linear_dynamic(x, packed, False), torch.float32)
    except (RuntimeError, AttributeError) as e:
        log.info("fbgemm dynamic linear unavailable: %s", str(e).splitlines()[0])
    return ways


def run(model_dir: str, rows_list: list[int], min_seconds: float) -> dict:
    """{rows: {way: (seconds, worst relative error)}} over the model's linears."""
    import warnings

    warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
    shapes = linear_shapes(model_dir)
    weights = real_weights(model_dir, shapes)
    per_shape = {s: _ways(w) for s, w in weights.items()}
    results = {}
    for rows in rows_list:
        seconds, errors = Counter(), Counter()
        for s, ways in per_shape.items():
            x = activations(rows, s[1])
            ref = x.double() @ weights[s].double().t()
            for way, (fn, dtype) in ways.items():
                xin = x.to(dtype)
                out = fn(xin).double()
                errors[way] = max(errors[way], ((out - ref).abs().max() / ref.abs().max()).item())
                seconds[way] += _time(lambda fn=fn, xin=xin: fn(xin), min_seconds) * shapes[s]
        results[rows] = {w: (seconds[w], errors[w]) for w in seconds}
    return results


def report(results: dict, shapes: Counter) -> None:
    for rows, ways in results.items():
        flops = sum(2 * rows * o * i * n for (o, i), n in shapes.items())
        t16, t32 = ways.get("bf16 packed", (float("nan"),))[0], ways["fp32 packed"][0]
        log.info("rows %d (%.2f GFLOP a forward's linears)", rows, flops / 1e9)
        log.info("  %-15s %9s %9s %8s %8s %9s", "way", "ms", "GFLOP/s", "vs bf16", "vs fp32", "max err")
        for way, (t, err) in sorted(ways.items(), key=lambda kv: kv[1][0]):
            log.info("  %-15s %9.2f %9.1f %8.2f %8.2f %9.2e", way, t * 1e3, flops / t / 1e9, t16 / t, t32 / t, err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or directory (default smollm2)")
    ap.add_argument("--rows", default="1,8,32,64,256", help="rows per call (a step's tokens), comma-separated")
    ap.add_argument("--min-seconds", type=float, default=0.3, help="time each (way, shape) at least this long")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from engine.models.model_names import resolve_model_arg

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_arg(args.model)
    shapes = linear_shapes(model_dir)
    log.info("%s: linears %s; torch %s, ATen %s, %d threads%s; engine int8 kernel %s", args.model, dict(shapes),
             torch.__version__, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(),
             f", ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}" if "ONEDNN_MAX_CPU_ISA" in os.environ else "",
             int8_linears.kernel())
    report(run(model_dir, [int(r) for r in args.rows.split(",")], args.min_seconds), shapes)


if __name__ == "__main__":
    main()
