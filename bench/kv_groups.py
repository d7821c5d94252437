"""Gemma 3 1B (five windowed layers of six) holding long rollouts: our engine with a KV cache per group
of layers (engine/kv_groups.py: the full layers' at full length, the windowed layers' their last window)
against the same engine keeping one cache of every layer at full length (`disable_hybrid_kv_cache_manager`:
what it did before, and what an engine without a hybrid allocator does), side by side in one run.

The model: Gemma 3 1B's real config (bench/model_shapes.py: window 512 on 22 of 26 layers, one KV head of
256; random weights, SmolLM2's tokenizer). Printed first, for `--size-seqs` sequences of `--size-len`
tokens: each engine's default cache (every running sequence at full length, or at its window), in blocks
and bytes, against the fewest bytes the windows allow. Then the workload: `--seqs` prompts of 64-128 tokens,
`--max-tokens` new tokens each (ignore_eos, greedy), both engines given the same `--budget-gb` of KV
cache (too little for one cache of every layer at full length): tok/s and preemptions (each a
recompute of the sequence so far); the greedy tokens must agree.

    python -m bench.kv_groups
    python -m bench.kv_groups --seqs 16 --max-tokens 1024 --budget-gb 0.25
"""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger("bench.kv_groups")


def engine(model: str, hybrid: bool, dtype: str, **kw):
    from engine import LLM, EngineConfig

    return LLM(EngineConfig(model=model, dtype=dtype, disable_hybrid_kv_cache_manager=not hybrid, **kw))


def cache_sizes(model: str, args) -> dict:
    """Each engine's default cache for --size-seqs sequences of --size-len tokens: blocks per group, bytes."""
    out = {}
    for name, hybrid in (("groups", True), ("one", False)):
        llm = engine(model, hybrid, args.dtype, max_num_seqs=args.size_seqs, max_model_len=args.size_len,
                     kv_cache_memory_gb=1024.0)  # the wanted size, not a budget's (allocated lazily: zero pages)
        runner = llm.core.runner
        out[name] = {"blocks": runner.group_blocks, "bytes": llm.core.worker.memory()["kv_cache"],
                     "per_token_layer": 2 * runner.num_kv_heads * runner.head_dim * runner.k_cache.element_size(),
                     "windows": runner.kv_groups.windows, "layers": [len(runner.kv_groups.layers(g))
                                                                     for g in range(len(runner.kv_groups.windows))]}
        del llm
    return out


def run(model: str, hybrid: bool, args, prompts: list[list[int]]) -> dict:
    """One engine's tokens/s and preemptions on `prompts` in a cache of --budget-gb."""
    from bench.window_blocks import timed_greedy

    llm = engine(model, hybrid, args.dtype, max_num_seqs=args.seqs, max_model_len=128 + args.max_tokens,
                 block_size=args.block_size, kv_cache_memory_gb=args.budget_gb)
    return {**timed_greedy(llm, prompts, args.max_tokens), "blocks": llm.core.runner.group_blocks,
            "bytes": llm.core.worker.memory()["kv_cache"]}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_groups", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--shape", default="gemma3-1b", help="a bench/model_shapes.py shape (default: gemma3-1b)")
    p.add_argument("--seqs", type=int, default=16, help="sequences at once (default: 16)")
    p.add_argument("--max-tokens", type=int, default=1024, help="new tokens per sequence (default: 1024)")
    p.add_argument("--budget-gb", type=float, default=0.25, help="KV cache for both engines, GiB (default: 0.25)")
    p.add_argument("--size-seqs", type=int, default=64, help="sequences of the default-size table (default: 64)")
    p.add_argument("--size-len", type=int, default=4096, help="their max_model_len (default: 4096)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import random

    import torch

    from bench.model_shapes import shape_dir

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    model = str(shape_dir(args.shape))
    sizes = cache_sizes(model, args)
    g, one = sizes["groups"], sizes["one"]
    window = g["windows"][-1]  # every sequence's window on the windowed layers, its whole length on the others
    fewest = args.size_seqs * g["per_token_layer"] * (g["layers"][0] * args.size_len + g["layers"][1] * window)
    print(f"kv_groups: {args.shape} (random weights), {args.dtype}, windows {g['windows']} on "
          f"{g['layers']} layers; default caches for {args.size_seqs} sequences of {args.size_len} tokens:")
    print(f"  a cache per group {g['blocks']} blocks, {g['bytes'] / 2**30:.2f} GiB; one cache {one['blocks']} "
          f"blocks, {one['bytes'] / 2**30:.2f} GiB: {one['bytes'] / g['bytes']:.2f}x less; the fewest the windows "
          f"allow (every sequence its window, no prefill step's room) {fewest / 2**30:.2f} GiB "
          f"({g['bytes'] / fewest:.2f}x that)")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(64, 128))] for _ in range(args.seqs)]
    on = run(model, True, args, prompts)
    off = run(model, False, args, prompts)
    if on["tokens"] != off["tokens"]:
        raise SystemExit("the two runs' greedy tokens differ")
    print(f"workload: {args.seqs} seqs x {args.max_tokens} new tokens (prompts 64-128), blocks of {args.block_size}, "
          f"{args.budget_gb} GiB of KV cache each, {torch.get_num_threads()} threads")
    print(f"{'':24} {'tok/s':>8} {'s':>7} {'preemptions':>12} {'blocks':>14} {'GiB':>6}")
    for name, r in (("a cache per group", on), ("one cache", off)):
        print(f"{name:24} {r['tok_s']:8.1f} {r['seconds']:7.1f} {r['preemptions']:12d} "
              f"{'+'.join(map(str, r['blocks'])):>14} {r['bytes'] / 2**30:6.3f}")
    print(f"ratio: tok/s a cache per group / one cache {on['tok_s'] / off['tok_s']:.2f}; the same greedy tokens")


if __name__ == "__main__":
    main()
