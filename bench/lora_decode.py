"""What unmerged LoRA costs the engine per token: rollout tokens/s of a sidecar serving a LoRA
adapter merged into its weights (`--lora-versions 0`, the default) against the same adapter kept
unmerged beside the base (`--lora-versions 4`: extra low-rank matmuls per target layer, and
per-row grouping when sequences of several versions share a step).

For each model: one sidecar per setting, the same adapter pushed (r = --lora-r, attention + MLP
targets), then `--repeats` timed batches of `--prompts` x `--max-tokens` sampled tokens. The
unmerged run times two cases: every sequence on one version, and half the batch started under
the previous version (a keep-mode push mid-rollout leaves such batches). Also the engine's FLOP/s
(2 x params per token, the adapter's own FLOPs left out) as a fraction of the matmul peak probed
on this machine.

    python -m bench.lora_decode                     # small model
    python -m bench.lora_decode --models small,medium
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time

log = logging.getLogger("bench.lora_decode")


def lora_model(model_dir: str, r: int, seed: int):
    """bench.lora_push's trainer model, its factors moved once (PEFT starts B at zero)."""
    import torch

    from bench.lora_push import lora_model as peft_model, train_step

    model = peft_model(model_dir, r, 2 * r, seed)
    train_step(model, torch.Generator().manual_seed(seed), scale=0.01)
    return model


def timed_batches(client, prompts, params, repeats: int) -> float:
    """Median tokens/s over `repeats` batches."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        groups = client.generate(prompts, params)
        rates.append(sum(len(r.token_ids) for g in groups for r in g) / (time.perf_counter() - t0))
    return statistics.median(rates)


def two_versions(url: str, client, adapter, prompts, params, version: int) -> float:
    """Tokens/s of a batch whose first half started under the previous version: half is
    submitted, the next version pushed in keep mode, then the second half."""
    from rollout import RolloutClient

    half = len(prompts) // 2
    done = {}

    def first_half():
        c = RolloutClient(url)
        try:
            done["a"] = c.generate(prompts[:half], params)
        finally:
            c.close()

    t0 = time.perf_counter()
    th = threading.Thread(target=first_half)
    th.start()
    time.sleep(0.2)
    client.push_weights(adapter, version=version, pause_mode="keep")
    b = client.generate(prompts[half:], params)
    th.join()
    seconds = time.perf_counter() - t0
    versions = {v for g in done["a"] for r in g for v in r.weight_versions}
    log.info("two-version batch: first half's versions %s", sorted(versions))
    return sum(len(r.token_ids) for g in done["a"] + b for r in g) / seconds


def run(model_dir: str, lora_versions: int, r: int, n_prompts: int, max_tokens: int, repeats: int) -> dict:
    from engine import SamplingParams
    from rollout import RolloutClient
    from rollout.launcher import LocalSidecar

    adapters = [lora_model(model_dir, r, seed) for seed in (1, 2, 3)]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8] for i in range(n_prompts)]
    sidecar = LocalSidecar(model_dir, "--lora-versions", str(lora_versions), "--max-model-len", "512",
                           "--stats-interval", "0", "--log-level", "WARNING", "--host-copy", "off")
    client = RolloutClient(sidecar.url)
    try:
        client.init_weight_sync()
        client.push_weights(adapters[0], version=1)
        client.generate(prompts[:4], params)  # warm-up
        out = {"one_version": timed_batches(client, prompts, params, repeats)}
        if lora_versions:
            out["two_versions"] = statistics.median(
                two_versions(sidecar.url, client, adapters[1 + k % 2], prompts, params, 2 + k) for k in range(repeats))
        return out
    finally:
        client.close()
        sidecar.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lora_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small", help="comma-separated model names or directories (default: small)")
    p.add_argument("--lora-r", type=int, default=16, help="adapter rank (default 16)")
    p.add_argument("--prompts", type=int, default=32, help="sequences per batch (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per case (default 3)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("weight_sync").setLevel(logging.WARNING)
    from bench.engine_throughput import probe_gflops
    from bench.lora_push import TARGET_MODULES
    from bench.http import _count_params
    from engine.models.model_names import resolve_model_arg

    rows = []
    for name in args.models.split(","):
        model_dir = resolve_model_arg(name)
        probes = [probe_gflops()]
        merged = run(model_dir, 0, args.lora_r, args.prompts, args.max_tokens, args.repeats)
        probes.append(probe_gflops())
        unmerged = run(model_dir, 4, args.lora_r, args.prompts, args.max_tokens, args.repeats)
        probes.append(probe_gflops())
        rows.append((name, _count_params(model_dir), statistics.median(probes), merged, unmerged))
        log.info("%s: merged %s, unmerged %s", name, merged, unmerged)
    print(f"\nLoRA r={args.lora_r} on {', '.join(TARGET_MODULES)}; {args.prompts} x {args.max_tokens} tokens a batch")
    print(f"{'model':8} {'params':>8} {'merged tok/s':>13} {'unmerged, 1 version':>20} {'ratio':>6} "
          f"{'unmerged, 2 versions':>21} {'ratio':>6} {'merged of peak':>15}")
    for name, n, peak, merged, unmerged in rows:
        m, u1, u2 = merged["one_version"], unmerged["one_version"], unmerged["two_versions"]
        print(f"{name:8} {n / 1e6:7.0f}M {m:13.0f} {u1:20.0f} {u1 / m:6.2f} {u2:21.0f} {u2 / m:6.2f} "
              f"{2 * n * m / 1e9 / peak:15.3f}")
    print("(the two-version case includes a keep-mode push inside its timing)")


if __name__ == "__main__":
    main()
