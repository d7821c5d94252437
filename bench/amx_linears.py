"""The engine's linears on AMX tiles (engine/kernels/amx_linears.py) against oneDNN's op, side by side in
one run: a whole model's linears swept in a forward's order (each layer's fused q/k/v, o, fused
gate/up, down, then the lm_head), every layer its own weights, so they stream through the caches as
in a decode step (each way's sweeps back to back, as an engine's steps are). bf16 (packed copies, and
"bf16 rows": the bf16 engine's own way, the weights read in place) and int8 (the int8 engine's:
weight-only "w8", and per token, activations quantized and scales applied: what a forward pays).

Each figure: ms per sweep, the weights' bytes per second, and that against this CPU's memory read
probe (torch's sum over 1 GiB, the same threads): how far from the machine's limit a sweep is. The
weights and every copy are put on 2 MB pages first, as the engine's collapser puts its own
(engine/kernels/huge_pages.py; `--no-huge-pages`: as they were allocated).

    python -m bench.amx_linears                  # SmolLM2-135M, rows 1,8,32,64,256
    python -m bench.amx_linears --rows 32 --repeats 20
"""

from __future__ import annotations

import argparse
import functools
import logging
import time

import torch

from engine.kernels import amx_linears, derived_weights, huge_pages, int8_linears

log = logging.getLogger("bench.amx_linears")


def model_linears(model_name: str) -> list[torch.Tensor]:
    """The model's linear weights in bf16, grouped as the engine serves them (fused_linears)."""
    from engine.config import EngineConfig
    from engine.models.model_loader import load_model
    from engine.models.model_names import resolve_model_arg

    cfg = EngineConfig(model=resolve_model_arg(model_name), dtype="bfloat16", prepack_linears=False)
    model = load_model(cfg, torch.device("cpu"))
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight]
    out.append(model.lm_head.weight)
    return [w.detach().contiguous() for w in out]


def read_bandwidth() -> float:
    """Bytes per second torch reads a 1 GiB tensor at (sum), the best of 5."""
    x = torch.ones(1 << 28)
    x.sum()
    best = min(_seconds(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def activations(dtype: torch.dtype):
    """x_of(rows, k): a [rows, k] normal activation in `dtype`, made once a shape, before the timed calls
    read it (a `randn` inside each call was timed with the linear)."""
    return functools.cache(lambda rows, k: torch.randn(rows, k).to(dtype))


def sweep_of(weights: list[torch.Tensor], x_of, apply):
    """fn(rows) calling apply(i, x [rows, k_i]) for every linear i once, in a forward's order."""
    def sweep(rows: int):
        for i, w in enumerate(weights):
            apply(i, x_of(rows, w.shape[1]))
    return sweep


def _tensors(copies) -> list[torch.Tensor]:
    """The tensors under each copy (a tensor, or an object holding one as `packed`, perhaps nested)."""
    out = []
    for c in copies:
        while not isinstance(c, torch.Tensor) and hasattr(c, "packed"):
            c = c.packed
        if isinstance(c, torch.Tensor):
            out.append(c)
    return out


def sweeps(weights: list[torch.Tensor], huge: bool = True) -> dict:
    """way -> (fn(rows) running every linear once, bytes of weight it streams); `huge`: the weights and
    the copies on 2 MB pages first, as the engine serves them (oneDNN's opaque copies cannot be)."""
    bf16_dnn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    bf16_amx = [amx_linears.pack(w) for w in weights]
    bf16_rows = [derived_weights.rows_of(w) for w in weights]  # what the bf16 engine runs: no copy
    body = weights[:-1]  # the int8 engine keeps the lm_head in bf16 (int8_linears.KEEP_FULL_PRECISION)
    s8_dnn = [int8_linears.derive(w, ("onednn", 127)) for w in body]
    s8_amx = [int8_linears.derive(w, ("amx", 127)) for w in body]
    w8_amx = [int8_linears.derive(w, ("amx_w8", 127)) for w in body]
    w8_head = int8_linears.derive(weights[-1], ("amx_w8", 127))
    if huge:
        huge_pages.collapse([*weights, *_tensors([*bf16_amx, *s8_amx, *w8_amx, w8_head])])
    lin = torch.nn.Linear(1, 1, bias=False)  # _int8_apply reads nothing of it but the bias it is given
    dense = sum(w.numel() for w in weights) * 2
    s8 = sum(w.numel() for w in body) + weights[-1].numel() * 2

    x_of = activations(torch.bfloat16)

    def run(x_of, apply):
        return sweep_of(weights, x_of, apply)

    def dnn16(i, x):
        torch.ops.mkldnn._linear_pointwise(x, bf16_dnn[i], None, "none", [], "")

    def amx16(i, x):
        amx_linears.linear_bf16(x, bf16_amx[i])

    def rows16(i, x):
        amx_linears.linear_bf16_rows(x, bf16_rows[i])

    def int8(copies, head):
        def apply(i, x):
            if i < len(copies):
                int8_linears._int8_apply(lin, x, copies[i], None)
            else:
                head(i, x)
        return apply

    def w8_with_head(i, x):
        int8_linears._int8_apply(lin, x, w8_amx[i] if i < len(w8_amx) else w8_head, None)

    w8_bytes = sum(w.nbytes for w in w8_amx)

    return {"bf16 oneDNN": (run(x_of, dnn16), dense), "bf16 AMX": (run(x_of, amx16), dense),
            "bf16 rows": (run(x_of, rows16), dense),
            "int8 oneDNN": (run(x_of, int8(s8_dnn, dnn16)), s8), "int8 AMX": (run(x_of, int8(s8_amx, amx16)), s8),
            "w8 AMX": (run(x_of, int8(w8_amx, amx16)), w8_bytes + weights[-1].numel() * 2),
            "w8 AMX +head": (run(x_of, w8_with_head), w8_bytes + w8_head.nbytes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or directory (default smollm2)")
    ap.add_argument("--rows", default="1,8,32,64,256",
                    help="rows per call (a decode step's sequences), comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="sweeps per way, row count and round (the best is kept)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-huge-pages", action="store_true",
                    help="leave the weights on the pages they were allocated on (default: on 2 MB pages, as the "
                         "engine serves them)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not amx_linears.available():
        raise SystemExit("no AMX tiles on this CPU (or ROLLOUT_AMX=0): nothing to compare")
    weights = model_linears(args.model)
    bandwidth = read_bandwidth()
    log.info("%s: %d linears, %.0f MB in bf16; memory read probe %.1f GB/s; %d threads", args.model, len(weights),
             sum(w.numel() for w in weights) * 2 / 1e6, bandwidth / 1e9, torch.get_num_threads())
    ways = sweeps(weights, huge=not args.no_huge_pages and huge_pages.enabled())
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            best = {}
            # each way's sweeps back to back, as an engine's steps run: one model's copy (0.2-0.3 GB)
            # may stay in a large L3 between them, which interleaving the ways' copies would defeat;
            # two rounds in opposite orders, so a noisy neighbour hits each way alike
            for order in (list(ways), list(ways)[::-1]):
                for way in order:
                    fn = ways[way][0]
                    for _ in range(args.repeats):
                        best[way] = min(best.get(way, float("inf")), _seconds(lambda: fn(rows)))
            best = {way: best[way] for way in ways}
            cells = [f"{way} {t * 1e3:.2f} ms ({ways[way][1] / t / 1e9:.1f} GB/s, {ways[way][1] / t / bandwidth:.0%})"
                     for way, t in best.items()]
            log.info("rows %3d: %s | AMX/oneDNN bf16 %.2fx, int8 %.2fx; on AMX over bf16: int8 %.2fx, "
                     "weight-only int8 %.2fx, with the lm_head %.2fx", rows, " | ".join(cells),
                     best["bf16 oneDNN"] / best["bf16 AMX"], best["int8 oneDNN"] / best["int8 AMX"],
                     best["bf16 AMX"] / best["int8 AMX"], best["bf16 AMX"] / best["w8 AMX"],
                     best["bf16 AMX"] / best["w8 AMX +head"])
            log.info("rows %3d: the engines' own ways (bf16 engine: bf16 rows in place; int8 engine: w8 AMX, "
                     "its lm_head in bf16): int8 over bf16 %.2fx", rows, best["bf16 rows"] / best["w8 AMX"])


if __name__ == "__main__":
    main()
