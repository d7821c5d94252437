"""Weight-sync push speed against the transport's limit and the naive pattern.

For each model (fp32, CPU, gloo), through a real AsyncEngine whose worker runs the weight-sync
extension, this process being the trainer (rank 0):

  ours        `push_to_engines`: manifest + validation, bucketed double-buffered broadcast into
              staging, commit vote, commit, prefix-cache reset and version tag; timed from the
              trainer's start to the engine's answer (weights committed)
  raw         one gloo broadcast of one flat, pre-allocated buffer of the same bytes + a 1-element
              all-reduce acknowledgement: what the transport can do at best
  per-param   one broadcast per parameter into a freshly allocated tensor, copied into the
              parameter in place (the simple servers' pattern; no validation, no atomicity)

Seconds per push (median of --repeats after a warm-up), effective GB/s, and the median of the
per-push ratios raw / push (each push right after its own raw broadcast, both right after an
in-place write of every weight as an optimizer step does: the ratio holds while the machine's
speed drifts). The default (trainer flattened, staging memory kept: what the recipes
run on CPU) is interleaved round by round with an unflattened trainer; then fresh staging memory
every push (keep_staging=False) and a bucket-size sweep (the default, DEFAULT_BUCKET_BYTES, is
chosen from it), one block each.

    python -m bench.weight_sync                 # small (~50M) and medium (~500M) models
    python -m bench.weight_sync --quick         # smoke run on the tiny model
    python -m bench.weight_sync --trainer-device cuda:0 --engine-device cuda:1   # NCCL, two GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time

import torch

from weight_sync.engine_side.extension import WeightSyncExtension

log = logging.getLogger("bench.weight_sync")
TARGET_RATIO = 0.85
EXT = "bench.weight_sync:BenchExtension"


class BenchExtension(WeightSyncExtension):
    """The production extension plus the two baselines' receiving sides (benchmark only)."""

    def bench_raw_receive(self, nbytes: int, repeats: int) -> bool:
        g = self._receiver().group
        spare = self._receiver().pool.spare  # kept staging memory is warm: no extra copy, no page faults
        buf = getattr(self, "_bench_buf", None)
        if spare is not None and spare.numel() >= nbytes:
            buf = spare[:nbytes]
        elif buf is None or buf.numel() < nbytes:
            buf = self._bench_buf = torch.zeros(int(nbytes), dtype=torch.uint8, device=self.device)
        for _ in range(repeats):
            g.wait(g.broadcast(buf[:nbytes], src=0))
            g.allreduce_max(torch.zeros(1, dtype=torch.int64), "ack")
        return True

    def bench_per_param_receive(self, specs: list, repeats: int) -> bool:
        from weight_sync.common.manifest import DTYPES

        g = self._receiver().group
        params = dict(self.model.named_parameters())
        for _ in range(repeats):
            for name, dtype, shape in specs:
                t = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
                g.wait(g.broadcast(t.view(-1).view(torch.uint8), src=0))
                with torch.no_grad():
                    params[name].copy_(t)
            g.allreduce_max(torch.zeros(1, dtype=torch.int64), "ack")
        return True


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def bench_model(size: str, buckets_mib: list[int], repeats: int, timeout_s: float,
                      trainer_device: str = "cpu", engine_device: str = "cpu") -> dict:
    """Every timed push of ours is paired with a raw broadcast right before it, so the ratios hold
    even when the machine's load drifts during the run. On CUDA (trainer and engine on two GPUs)
    the group is NCCL and the raw baseline an NCCL broadcast."""
    from transformers import AutoModelForCausalLM

    from engine import AsyncEngine, EngineConfig
    from engine.models.tiny_model import build_tiny_model, default_model_dir
    from weight_sync import WeightSender, flatten_parameters
    from weight_sync.common.manifest import DEFAULT_BUCKET_BYTES
    from weight_sync.engine_side.engines import engines_checksums
    from weight_sync.trainer.local_engines import init_weight_sync, push_to_engines

    model_dir = str(build_tiny_model(default_model_dir(size), size, "qwen2"))
    # The trainer's weights laid out as a push lays them out, as the recipes do on CPU
    # (weight_sync.flatten_parameters); a plain copy shows the packing path.
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(trainer_device)
    flatten_parameters(trainer)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(trainer_device)
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    nparams = sum(p.numel() for p in trainer.parameters())
    log.info("%s: %.1fM parameters, %.1f MB fp32", size, nparams / 1e6, nbytes / 1e6)
    engine = AsyncEngine(EngineConfig(model=model_dir, device=engine_device, max_num_seqs=4, max_model_len=256,
                                      kv_cache_memory_gb=0.05, gpu_memory_utilization=0.5, worker_extension_cls=EXT))
    sender = WeightSender(timeout_s=timeout_s, device=trainer_device)
    out = {"size": size, "params": nparams, "bytes": nbytes, "ours": {}, "ratio": {}, "extra": {}, "raw_samples": [],
           "backend": "nccl" if torch.device(trainer_device).type == "cuda" else "gloo"}
    raw_buf = torch.ones(nbytes, dtype=torch.uint8, device=trainer_device)
    try:
        def nudge(model):
            """New values in every parameter before each push, written as an optimizer step writes
            them (in place, every byte)."""
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 1e-4)

        async def raw_once() -> float:
            grp = sender.group

            def send() -> float:
                t0 = time.perf_counter()
                grp.wait(grp.broadcast(raw_buf, src=0))
                grp.allreduce_max(torch.zeros(1, dtype=torch.int64), "ack")
                return time.perf_counter() - t0

            fut = asyncio.ensure_future(asyncio.to_thread(send))
            await engine.collective_rpc("bench_raw_receive", timeout=timeout_s, args=(nbytes, 1))
            return await fut

        async def rounds(variants: list[tuple], keep: bool | None, warmup: int = 5) -> None:
            """Form a group, then `warmup` + `repeats` rounds; each round pushes every variant
            (bucket MiB, model, label) once, right after a raw broadcast. Interleaving keeps the
            machine's drift (on this VM, pushes early in a process run slower for ~10 s) from
            landing on one variant. keep=None: the worker's default staging policy."""
            await init_weight_sync([engine], sender, timeout_s=timeout_s, keep_staging=keep)
            times = {label: [] for _, _, label in variants}
            ratios = {label: [] for _, _, label in variants}
            extra = {label: [] for _, _, label in variants}
            for i in range(warmup + repeats):
                for mib, model, label in variants:
                    sender.bucket_bytes = mib * 2**20
                    nudge(model)  # both right after an optimizer-like write: its OpenMP threads
                    raw = await raw_once()  # spin on for a while and slow whatever follows
                    nudge(model)
                    t0 = time.perf_counter()
                    await push_to_engines([engine], sender, model, version=next(versions), timeout=timeout_s)
                    dt = time.perf_counter() - t0
                    if i >= warmup:
                        times[label].append(dt)
                        ratios[label].append(raw / dt)
                        extra[label].append(dt - raw)
                        out["raw_samples"].append(raw)
            (got,) = await engines_checksums([engine])
            assert got == sender.checksum(variants[-1][1]), "engine weights differ from the trainer's"
            for mib, _, label in variants:
                key = f"{mib}MiB{label}"
                out["ours"][key], out["ratio"][key] = _median(times[label]), _median(ratios[label])
                out["extra"][key] = _median(extra[label])
                log.info("%s ours bucket=%s: %.3fs (%.2f GB/s), %.2f of raw", size, key, out["ours"][key],
                         nbytes / out["ours"][key] / 1e9, out["ratio"][key])

        # The defaults as the recipes get them (trainer flattened; on CPU the staging buffer is
        # kept between pushes) interleaved with a trainer that is not flattened (buckets packed);
        # then fresh staging memory every push (keep_staging=False: the memory-frugal option);
        # then the bucket-size sweep (one size at a time: a push reuses the previous push's
        # layout only at the same size, as in training).
        versions = iter(range(1, 10**9))
        default_mib = DEFAULT_BUCKET_BYTES // 2**20
        await rounds([(default_mib, trainer, " (default, flattened trainer)"),
                      (default_mib, plain, " trainer not flattened")], keep=None)
        await rounds([(default_mib, trainer, " keep_staging=False")], keep=False, warmup=3)
        for mib in buckets_mib:
            if mib != default_mib:
                await rounds([(mib, trainer, " keep_staging")], keep=True, warmup=3)
        out["raw"] = _median(out["raw_samples"])
        log.info("%s raw broadcast: %.3fs (%.2f GB/s)", size, out["raw"], nbytes / out["raw"] / 1e9)

        # per-parameter: one broadcast per tensor (tied weights once), in-place load
        named = [(n, p.detach()) for n, p in trainer.named_parameters()]
        specs = [[n, str(p.dtype).removeprefix("torch."), list(p.shape)] for n, p in named]
        grp = sender.group

        def per_param_send() -> float:
            t0 = time.perf_counter()
            for _, p in named:
                grp.wait(grp.broadcast(p.reshape(-1).view(torch.uint8), src=0))
            grp.allreduce_max(torch.zeros(1, dtype=torch.int64), "ack")
            return time.perf_counter() - t0

        times, ratios, extra = [], [], []
        for i in range(repeats + 1):
            nudge(trainer)
            raw = await raw_once()
            nudge(trainer)
            fut = asyncio.ensure_future(asyncio.to_thread(per_param_send))
            await engine.collective_rpc("bench_per_param_receive", timeout=timeout_s, args=(specs, 1))
            dt = await fut
            if i:
                times.append(dt)
                ratios.append(raw / dt)
                extra.append(dt - raw)
        out["per_param"], out["per_param_ratio"], out["per_param_extra"] = _median(times), _median(ratios), _median(extra)
        log.info("%s per-param: %.3fs (%.2f GB/s), %.2f of raw", size, out["per_param"],
                 nbytes / out["per_param"] / 1e9, out["per_param_ratio"])
    finally:
        sender.close_group()
        engine.shutdown()
    return out


def report(results: list[dict]) -> str:
    """Seconds per push (median), GB/s, the median of the per-pair ratios raw / variant, and the
    median of the per-pair differences variant - raw (what a push costs beyond the bytes)."""
    lines = []
    for r in results:
        gb = r["bytes"] / 1e9
        lines.append(f"\n{r['size']}: {r['params'] / 1e6:.1f}M params, {r['bytes'] / 1e6:.0f} MB fp32")
        lines.append(f"  {'variant':<52}{'s/push':>8}{'GB/s':>7}{'vs raw':>8}{'+ms':>8}")
        rows = [(f"raw {r.get('backend', 'gloo')} broadcast (1 flat buffer)", r["raw"], 1.0, 0.0),
                ("one broadcast per param", r["per_param"], r["per_param_ratio"], r["per_param_extra"])]
        rows += [(f"ours, bucket {k}", v, r["ratio"][k], r["extra"][k]) for k, v in r["ours"].items()]
        for name, s, ratio, extra in rows:
            lines.append(f"  {name:<52}{s:>8.3f}{gb / s:>7.2f}{ratio:>8.2f}{extra * 1e3:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small,medium",
                   help="model sizes from engine.models.tiny_model (default: small,medium)")
    p.add_argument("--buckets-mib", default="4,16,64,256", help="bucket sizes to sweep, MiB (default: 4,16,64,256)")
    p.add_argument("--repeats", type=int, default=10, help="timed pushes per variant, after warm-up (default: 10)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="weight-sync group timeout (default: 120)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, two bucket sizes, one repeat")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--trainer-device", default="cpu", help="the trainer's device (cuda:0 for an NCCL run)")
    p.add_argument("--engine-device", default="cpu", help="the engine's device (another GPU: cuda:1)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--lora", action="store_true",
                   help="run the LoRA benchmark instead (adapter vs merged pushes, bench/lora_push.py); the other "
                        "options then go to it: python -m bench.weight_sync --lora --help")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--lora" in argv:
        from bench.lora_push import main as lora_main

        return lora_main([a for a in argv if a != "--lora"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.quick:
        args.sizes, args.buckets_mib, args.repeats = "tiny", "1,4", 1
    sizes = [s for s in args.sizes.split(",") if s]
    buckets = [int(b) for b in args.buckets_mib.split(",") if b]
    log.info("torch %s, %d threads, %d CPUs", torch.__version__, torch.get_num_threads(), os.cpu_count())

    async def run_all():
        return [await bench_model(s, buckets, args.repeats, args.timeout_s, args.trainer_device, args.engine_device)
                for s in sizes]

    results = asyncio.run(run_all())
    print(report(results))
    for r in results:
        best = max(r["ratio"], key=r["ratio"].get)
        default = next(k for k in r["ratio"] if "default" in k)
        print(f"{r['size']}: ours / raw = {r['ratio'][best]:.2f} at {best}, {r['ratio'][default]:.2f} at {default} "
              f"(target >= {TARGET_RATIO}); per-param / raw = {r['per_param_ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
