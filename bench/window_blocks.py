"""A model windowed on every layer (Mistral v0.1's, Phi-3-mini's) holding long rollouts in a KV cache sized for
its windows, not its full lengths: our engine handing back each sequence's blocks behind the window
as it decodes (engine/block_manager.py) against the same engine keeping them (what it did before, and
what an engine without a sliding-window manager does), side by side in one run.

The model: SmolLM2-135M's shape (bench/model_shapes.py, random weights) served as a Mistral with a window of
`--window` keys on every layer. The workload: `--seqs` prompts of 64-128 tokens, `--max-tokens` new tokens
each (ignore_eos, greedy), in the cache the engine sizes for itself where every layer has a window
(engine/kv_cache_size.py: each sequence its window's blocks and one prefill step's prompts), about half
of what the full lengths need. Printed per run: tok/s, preemptions (each a recompute of the sequence so far), the
most blocks in use at once, and the fewest the windows allow (every sequence its window's blocks and
the one being written).

    python -m bench.window_blocks
    python -m bench.window_blocks --seqs 16 --window 128 --max-tokens 512
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

log = logging.getLogger("bench.window_blocks")


def windowed_model(out: Path, window: int) -> str:
    """SmolLM2-135M's shape as a Mistral with `window` keys on every layer: its config over the shape's files."""
    from bench.model_shapes import shape_dir

    src = shape_dir("smollm2-135m")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            os.symlink(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=window)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def timed_greedy(llm, prompts: list[list[int]], max_tokens: int, before=lambda: None) -> dict:
    """Greedy rollouts of `prompts` (`max_tokens` each, ignore_eos) timed after a warm-up on two of them,
    the preemption count and the prefix cache reset (and `before()` called) between: tok/s, seconds,
    preemptions, each rollout's tokens."""
    from engine import SamplingParams

    scheduler = llm.core.scheduler
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    scheduler.num_preemptions = 0
    llm.core.block_manager.reset_prefix_cache()
    before()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "preemptions": scheduler.num_preemptions,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def run(model: str, release: bool, args, prompts: list[list[int]]) -> dict:
    """One engine's tokens/s, preemptions and peak blocks in use on `prompts`."""
    from engine import LLM, EngineConfig

    llm = LLM(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.seqs, block_size=args.block_size,
                           max_model_len=128 + args.max_tokens))
    bm, scheduler = llm.core.block_manager, llm.core.scheduler
    blocks = llm.core.runner.num_blocks  # the default size: the windows' (the same for both runs)
    assert bm.window == args.window, bm.window
    if not release:
        bm.window = None  # the blocks behind the window stay with their sequence (the engine before)
    peak = [0]
    schedule = scheduler.schedule

    def noting_peak():
        out = schedule()
        peak[0] = max(peak[0], blocks - bm.num_free_blocks)
        return out

    scheduler.schedule = noting_peak
    out = timed_greedy(llm, prompts, args.max_tokens, before=lambda: peak.__setitem__(0, 0))
    return {**out, "peak_blocks": peak[0], "cache_blocks": blocks}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.window_blocks", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--seqs", type=int, default=32, help="sequences at once (default: 32)")
    p.add_argument("--window", type=int, default=256, help="every layer's sliding window in keys (default: 256)")
    p.add_argument("--max-tokens", type=int, default=768, help="new tokens per sequence (default: 768)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import random

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(64, 128))] for _ in range(args.seqs)]
    with tempfile.TemporaryDirectory() as tmp:
        model = windowed_model(Path(tmp) / "model", args.window)
        on = run(model, True, args, prompts)
        off = run(model, False, args, prompts)
    if on["tokens"] != off["tokens"]:
        raise SystemExit("the two runs' greedy tokens differ")
    fewest = args.seqs * (-(-args.window // args.block_size) + 1)
    full = sum(-(-(len(q) + args.max_tokens) // args.block_size) for q in prompts)
    print(f"window_blocks: SmolLM2-135M's shape as Mistral, window {args.window} on every layer, {args.dtype}, "
          f"{args.seqs} seqs x {args.max_tokens} new tokens (prompts 64-128), blocks of {args.block_size}, "
          f"a cache of {on['cache_blocks']} blocks (the full lengths need {full}; the windows at least {fewest}), "
          f"{torch.get_num_threads()} threads")
    print(f"{'':24} {'tok/s':>8} {'s':>7} {'preemptions':>12} {'peak blocks':>12}")
    for name, r in (("handed back (ours)", on), ("kept (before)", off)):
        print(f"{name:24} {r['tok_s']:8.1f} {r['seconds']:7.1f} {r['preemptions']:12d} {r['peak_blocks']:12d}")
    print(f"ratio: tok/s handed back / kept {on['tok_s'] / off['tok_s']:.2f}; peak blocks {on['peak_blocks']} "
          f"= {on['peak_blocks'] / fewest:.2f}x the fewest the windows allow ({fewest}); the same greedy tokens")


if __name__ == "__main__":
    main()
