"""LoRA adapter pushes against merged full pushes of the same PEFT model.

A trainer that trains a LoRA adapter can push only the adapter's factors (lora_A, lora_B: a few
MB) and let the engine merge them into the base it keeps (weight_sync/common/lora.py,
weight_sync/engine_side/lora_target.py), or push the merged weights whole, as any other model.
For each model (engine.models.tiny_model sizes, fp32, CPU, gloo on loopback), through a real
AsyncEngine whose worker runs the weight-sync extension, this process being the trainer
(rank 0), with a PEFT LoRA model over the trainer's weights (r=--lora-r, lora_alpha=2r, on
q/k/v/o and gate/up/down projections) whose factors move a little before every push, as a
training step moves them:

  adapter   `push_to_engines(..., mode="adapter")`: the factors go, the engine merges them into
            its base (W = W0 + scale * B @ A for every target module) and commits
  merged    `push_to_engines(..., mode="merged")`: the trainer merges, every weight goes

Both are timed from the trainer's start to the engine's answer (weights committed, prefix cache
reset, version tagged), `--repeats` rounds of each after a warm-up push of each kind (the first
adapter push also brings the base). A merged push leaves the engine without a known base, so the
next adapter push brings the base again: every round is a timed merged push, an untimed adapter
push (with the base), an untimed adapter push (so the timed one is a training run's steady state:
the merge reuses the previous merge's memory), then the timed adapter push (checked to carry the
adapter's bytes only). Each model runs twice: with an engine that merges each adapter into its
weights (`--lora-versions 0`, the default), and with one that keeps adapters unmerged beside the
base (`--lora-versions 4`, engine/lora_bank.py: its commit stores the factors, no merge).

Printed per model: parameters, adapter MB, full MB, the median seconds per push of each kind,
their ratio merged / adapter (goal: >= 20x at the medium model, ~500M), the merge inside the
adapter push (milliseconds the engine spends computing the merged weights, and their share of
the push; measured by the benchmark's worker extension around the merge), and the merged
push's GB/s, end to end ("full") and on the wire alone ("wire": its bytes over the trainer's
send, the link's speed for context). After the last round, the engine's weights checksum must
equal that of PEFT's own `merge_and_unload()` of the trainer's model ("checksum ok"). Also
printed: the engine's receive and commit seconds, and how many cores other processes kept busy
just before and just after each model (sampled while this benchmark is idle): on a 2-core
machine another busy process makes every multi-threaded torch op wait for a descheduled thread
(seen here: 7-20 ms for a small matmul that takes 0.05 ms idle), and an adapter push's merge is
a few hundred such ops, so compare only runs with little other load.

    python -m bench.lora_push                               # small (~50M) and medium (~500M)
    python -m bench.lora_push --sizes tiny --repeats 1      # smoke run
    python -m bench.weight_sync --lora --sizes small        # the same, through bench.weight_sync
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import os
import statistics
import time

import torch


log = logging.getLogger("bench.lora_push")
GOAL_RATIO = 20.0  # merged / adapter seconds per push, at the medium model
GOAL_SIZE = "medium"
EXT = "bench.weight_sync:BenchExtension"  # a push's result says its merge time: `plan_seconds`
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def other_cores_busy(seconds: float = 1.0) -> float | None:
    """Cores the machine's other processes keep busy, from /proc/stat over `seconds` while this
    process sleeps (None where there is no /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v[:8]), v[3] + v[4]  # total (guest time is in user already), idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError):
        return None
    return (1 - (i1 - i0) / max(t1 - t0, 1)) * (os.cpu_count() or 1)


def _nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def lora_model(model_dir: str, r: int, alpha: float, seed: int):
    """The trainer's model as the recipes build it with --lora-r (recipes/rl_train.py,
    recipes/lora.py): fp32, flattened for pushes, then wrapped by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from weight_sync import flatten_parameters

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    flatten_parameters(base)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGET_MODULES, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def train_step(model, gen: torch.Generator, scale: float = 1e-3) -> None:
    """Move every LoRA factor a little, in place, as an optimizer step does (PEFT starts B at
    zero: without this the merged weights would be the base)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


async def bench_model(size: str, repeats: int, r: int, alpha: float, timeout_s: float, seed: int = 0,
                      lora_versions: int = 0, dtype: str = "float32") -> dict:
    from engine import AsyncEngine, EngineConfig
    from engine.model_runner import available_cpus
    from engine.models.model_names import resolve_model
    from weight_sync import WeightSender
    from weight_sync.common.checksum import weights_checksum
    from weight_sync.engine_side.engines import engines_checksums
    from weight_sync.trainer.local_engines import init_weight_sync, push_to_engines
    from weight_sync.trainer.lora_push import adapter_weights, base_weights

    model_dir = resolve_model(size)  # a tiny size (engine.models.tiny_model), or a real model's name (smollm2)
    peft_model = lora_model(model_dir, r, alpha, seed)
    gen = torch.Generator().manual_seed(seed)
    adapter_bytes = _nbytes(adapter_weights(peft_model)[0])  # the factors travel in their own dtype
    base = base_weights(peft_model)
    wire = torch.finfo(getattr(torch, dtype)).bits // 8
    full_bytes, nparams = sum(t.numel() * wire for _, t in base), sum(t.numel() for _, t in base)
    del base
    log.info("%s: %.1fM parameters, full %.1f MB fp32, adapter (r=%d) %.2f MB", size, nparams / 1e6,
             full_bytes / 1e6, r, adapter_bytes / 1e6)
    busy_before = other_cores_busy()  # before this benchmark's engine starts
    engine = AsyncEngine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=4, max_model_len=256,
                                      kv_cache_memory_gb=0.05, num_threads=available_cpus(),
                                      lora_versions=lora_versions, worker_extension_cls=EXT, dtype=dtype))
    # the weights travel in the engine's dtype, as a sidecar's client sends them (rollout.client.weight_sync_client)
    sender = WeightSender(timeout_s=timeout_s, dtype=getattr(torch, dtype))
    versions = iter(range(1, 10**9))
    out = {"size": size, "engine": ("unmerged" if lora_versions else "merged") + ("" if dtype == "float32" else " bf16"),
           "params": nparams, "lora_r": r,
           "adapter_bytes": adapter_bytes, "full_bytes": full_bytes,
           "other_cores_before": busy_before,
           "adapter_s": [], "merged_s": [], "merged_send_s": [], "merge_s": [], "merge_share": [], "receive_s": [],
           "commit_s": []}

    async def push(mode: str, expect_bytes: int, what: str) -> tuple[float, dict, dict]:
        train_step(peft_model, gen)
        t0 = time.perf_counter()
        res = await push_to_engines([engine], sender, peft_model, version=next(versions), timeout=timeout_s,
                                    mode=mode)
        dt = time.perf_counter() - t0
        sent = res["trainer"]["bytes"]
        assert sent == expect_bytes, f"{what} push moved {sent} bytes, expected {expect_bytes}"
        worker = res["worker_results"][0]
        log.debug("%s %s push v%d: %.4f s, %.2f MB, worker %s", size, what, res["version"], dt, sent / 1e6, worker)
        return dt, res["trainer"], worker

    try:
        await init_weight_sync([engine], sender, timeout_s=timeout_s)
        log.info("%s: warm-up (merged; adapter with its base; adapter)", size)
        await push("merged", full_bytes, "warm-up merged")
        await push("adapter", full_bytes + adapter_bytes, "warm-up adapter (+ base)")
        await push("adapter", adapter_bytes, "warm-up adapter")
        for i in range(repeats):
            merged_dt, trainer, _ = await push("merged", full_bytes, "merged")
            await push("adapter", full_bytes + adapter_bytes, "adapter (+ base, untimed)")  # the merged push dropped it
            await push("adapter", adapter_bytes, "adapter (untimed)")  # a training run's steady state from here
            adapter_dt, _, worker = await push("adapter", adapter_bytes, "adapter")
            out["merged_s"].append(merged_dt)
            out["merged_send_s"].append(trainer["seconds"])
            out["adapter_s"].append(adapter_dt)
            out["merge_s"].append(worker["plan_seconds"])
            out["merge_share"].append(worker["plan_seconds"] / adapter_dt)
            out["receive_s"].append(worker["receive_seconds"])
            out["commit_s"].append(worker["commit_seconds"])
            log.info("%s round %d/%d: adapter %.4f s (merge %.4f s), merged %.4f s: %.1fx", size, i + 1, repeats,
                     adapter_dt, worker["plan_seconds"], merged_dt, merged_dt / adapter_dt)
        if dtype == "float32":  # a bf16 engine's merge of fp32 factors: tests/rollout/test_lora_push.py
            (got,) = await engines_checksums([engine], timeout=timeout_s)
            reference = copy.deepcopy(peft_model).merge_and_unload()
            want = weights_checksum(reference.named_parameters())
            del reference
            assert got == want, f"{size}: the engine's weights differ from the trainer's merge_and_unload()"
        out["checksum_ok"] = dtype == "float32"
    finally:
        sender.close_group()
        engine.shutdown()
    out["other_cores_after"] = other_cores_busy()
    for key in ("adapter_s", "merged_s", "merged_send_s", "merge_s", "merge_share", "receive_s", "commit_s"):
        out[key + "_median"] = _median(out[key])
    out["ratio"] = out["merged_s_median"] / out["adapter_s_median"]
    log.info("%s: engine side of an adapter push (median): receive %.4f s (merge %.4f s of it), commit %.4f s",
             size, out["receive_s_median"], out["merge_s_median"], out["commit_s_median"])
    return out


def report(results: list[dict]) -> str:
    cols = [("model", 8, "s"), ("engine", 9, "s"), ("params", 9, "s"), ("adapter MB", 11, ".2f"), ("full MB", 9, ".1f"),
            ("adapter s/push", 15, ".4f"), ("merged s/push", 14, ".4f"), ("merged/adapter", 15, "s"),
            ("merge ms", 9, ".1f"), ("merge share", 12, ".0%"), ("full GB/s", 10, ".2f"),
            ("wire GB/s", 10, ".2f")]
    lines = ["".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w, _) in enumerate(cols))]
    for r in results:
        row = [r["size"], r["engine"], f"{r['params'] / 1e6:.1f}M", r["adapter_bytes"] / 1e6, r["full_bytes"] / 1e6,
               r["adapter_s_median"], r["merged_s_median"], f"{r['ratio']:.1f}x", r["merge_s_median"] * 1e3,
               r["merge_share_median"], r["full_bytes"] / r["merged_s_median"] / 1e9,
               r["full_bytes"] / r["merged_send_s_median"] / 1e9]
        lines.append("".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}{f if f != 's' else ''}}"
                             for i, (v, (_, w, f)) in enumerate(zip(row, cols))))
    return "\n".join(lines)


def _cores(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lora_push", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small,medium",
                   help="comma-separated model sizes from engine.models.tiny_model: micro, mini, tiny (~4M), "
                        "small (~50M), medium (~500M, 1.9 GB fp32) (default: small,medium)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed pushes of each kind per model, after the warm-up (default: 5)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default: 16)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank, 32 at r=16)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="weight-sync group timeout, seconds (default: 120)")
    p.add_argument("--seed", type=int, default=0, help="seed of the LoRA factors' steps (default: 0)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the engine's dtype, and the merged pushes' on the wire (the trainer stays fp32)")
    p.add_argument("--json", default=None, help="also write every figure (each push's seconds too) to this JSON file")
    p.add_argument("--log-level", default="INFO", help="INFO (default: a line per round) or DEBUG (a line per push)")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.repeats < 1 or args.lora_r < 1:
        p.error("--repeats and --lora-r must be >= 1")
    from engine.model_runner import available_cpus

    torch.set_num_threads(available_cpus())  # the trainer's merges and steps: the cores this process may use
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_r
    log.info("torch %s, %d threads; LoRA r=%d alpha=%g on %s", torch.__version__, torch.get_num_threads(),
             args.lora_r, alpha, ",".join(TARGET_MODULES))

    async def run_all():
        return [await bench_model(s, args.repeats, args.lora_r, alpha, args.timeout_s, args.seed, versions, args.dtype)
                for s in sizes for versions in (0, 4)]

    results = asyncio.run(run_all())
    print(report(results))
    for r in results:
        check = "checksum ok (engine == PEFT merge_and_unload of the trainer's model)" if r["checksum_ok"] else \
            "checksum not compared (bf16)"
        print(f"{r['size']}, {r['engine']} engine: {check}; "
              f"engine receive {r['receive_s_median'] * 1e3:.1f} ms (merge {r['merge_s_median'] * 1e3:.1f} ms of it), "
              f"commit {r['commit_s_median'] * 1e3:.1f} ms; other processes kept {_cores(r['other_cores_before'])} "
              f"cores busy before, {_cores(r['other_cores_after'])} after")
    goals = [r for r in results if r["size"] == GOAL_SIZE]
    if not goals:
        print(f"goal merged/adapter >= {GOAL_RATIO:.0f}x at {GOAL_SIZE}: not measured in this run "
              f"(--sizes {GOAL_SIZE})")
    for goal in goals:
        print(f"goal merged/adapter >= {GOAL_RATIO:.0f}x at {GOAL_SIZE}, {goal['engine']} engine: "
              f"{goal['ratio']:.1f}x, {'met' if goal['ratio'] >= GOAL_RATIO else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
