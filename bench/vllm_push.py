"""Weight pushes into vLLM against pushes into our engine (issue 31), on one model (fp32, CPU, gloo).

For each engine (`rollout.serve --engine vllm`, then `--engine native`; both with the default
overlapped receive) a RolloutClient trainer in this process pushes the model's weights, changed
in place before each push as an optimizer step changes them, several times, once with the
engine idle and once with rollouts decoding all the time (batches of short requests, back to
back, as bench.overlap). Per push:

  push s      the trainer's `push_weights` call, start to every engine committed
  transfer s  the sidecar's receive (the bytes arrive while the engine keeps serving)
  commit s    the sidecar's swap (`swap_seconds`: the workers' finish_staged_weights, i.e. their
              commit, vLLM's reload_weights from staging for vLLM, then the prefix-cache reset and
              the version tag)
  pause ms    the sidecar's `pause_seconds` for that push: no decode step can run in it
  vs raw      bytes/s as a fraction of a raw gloo broadcast of the same bytes between this process
              and an engine process (bench.weight_sync's raw baseline: one flat buffer + a
              1-element all-reduce acknowledgement), timed right before each push

Goals printed against: pause <= commit + 10 ms; bytes/s >= 0.8 of raw.

    .venv-vllm/bin/python -m bench.vllm_push                   # SmolLM2-135M (538 MB fp32), 5 pushes each
    .venv-vllm/bin/python -m bench.vllm_push --quick           # tiny model, 2 pushes
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import time

import torch

log = logging.getLogger("bench.vllm_push")
TARGET_PAUSE_OVER_COMMIT_S = 0.010
TARGET_VS_RAW = 0.8


class RawBroadcast:
    """A native AsyncEngine whose worker runs bench.weight_sync's BenchExtension (its raw receive)
    and a WeightSender in this process: `once()` is one raw gloo broadcast of `nbytes` into the
    engine's process, and its acknowledgement, in seconds."""

    def __init__(self, model_dir: str, nbytes: int, timeout_s: float = 120.0):
        from bench.weight_sync import EXT
        from engine import AsyncEngine, EngineConfig
        from weight_sync import WeightSender

        self.nbytes = nbytes
        self.timeout_s = timeout_s
        self.engine = AsyncEngine(EngineConfig(model=model_dir, max_num_seqs=4, max_model_len=256,
                                               kv_cache_memory_gb=0.05, worker_extension_cls=EXT))
        self.sender = WeightSender(timeout_s=timeout_s)
        self.buf = torch.ones(nbytes, dtype=torch.uint8)

    async def start(self) -> None:
        from weight_sync.trainer.local_engines import init_weight_sync

        await init_weight_sync([self.engine], self.sender, timeout_s=self.timeout_s)
        await self.once()  # first touch of both buffers

    async def once(self) -> float:
        grp = self.sender.group

        def send() -> float:
            t0 = time.perf_counter()
            grp.wait(grp.broadcast(self.buf, src=0))
            grp.allreduce_max(torch.zeros(1, dtype=torch.int64), "ack")
            return time.perf_counter() - t0

        sent = asyncio.ensure_future(asyncio.to_thread(send))
        await self.engine.collective_rpc("bench_raw_receive", timeout=self.timeout_s, args=(self.nbytes, 1))
        return await sent

    def close(self) -> None:
        self.sender.close_group()
        self.engine.shutdown()


def nudge(model) -> None:
    """New values in every parameter, written in place as an optimizer step writes them."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-4)


async def measure(url: str, trainer, raw: RawBroadcast, pushes: int, version: int) -> tuple[dict, int]:
    """Pushes idle, then pushes while rollouts decode; rows of figures per push."""
    from engine import SamplingParams
    from rollout import AsyncRolloutClient

    client = AsyncRolloutClient(url)
    await client.init_weight_sync()
    version += 1
    await client.push_weights(trainer, version=version)  # warm-up: the staging memory's first touch
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(16)]
    running, tokens = [True], [0]

    async def load():
        while running[0]:
            groups = await client.generate(prompts, params)
            tokens[0] += sum(len(r.token_ids) for g in groups for r in g)

    rows: dict[str, list[dict]] = {"idle": [], "decoding": []}
    loader = None
    try:
        for cond in rows:
            if cond == "decoding":
                loader = asyncio.ensure_future(load())
                await asyncio.sleep(1.0)
            for _ in range(pushes):
                nudge(trainer)
                raw_s = await raw.once()
                nudge(trainer)
                before = (await client.stats())[0]["pause_seconds"]
                version += 1
                t0 = time.perf_counter()
                out = await client.push_weights(trainer, version=version)
                push_s = time.perf_counter() - t0
                pause = (await client.stats())[0]["pause_seconds"] - before
                side = out["sidecars"][0]
                rows[cond].append({"push_s": push_s, "raw_s": raw_s, "transfer_s": side["transfer_seconds"],
                                   "commit_s": side.get("swap_seconds", float("nan")), "pause_s": pause,
                                   "bytes": side.get("bytes") or raw.nbytes})
                log.info("%s push v%d: %.3f s (raw %.3f s), transfer %.3f s, commit %.1f ms, pause %.1f ms", cond,
                         version, push_s, raw_s, rows[cond][-1]["transfer_s"], rows[cond][-1]["commit_s"] * 1e3,
                         pause * 1e3)
                await asyncio.sleep(0.3)
        (checksum,) = await client.weights_checksums()
        assert checksum == client.sender.checksum(trainer), "the engine's weights differ from the trainer's"
    finally:
        running[0] = False
        if loader is not None:
            await asyncio.gather(loader, return_exceptions=True)
        await client.close()
    return rows, version


def report(results: dict, nbytes: int) -> str:
    lines = [f"{'engine':<7} {'load':<9} {'push s':>7} {'raw s':>6} {'transfer s':>10} {'commit ms':>9} "
             f"{'pause ms':>8} {'pause-commit ms':>15} {'GB/s':>5} {'vs raw':>6}"]
    verdicts = []
    for engine, rows in results.items():
        for cond, rs in rows.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            vs_raw = statistics.median(r["raw_s"] / r["push_s"] for r in rs)  # paired: the machine drifts
            over = statistics.median(r["pause_s"] - r["commit_s"] for r in rs)
            lines.append(f"{engine:<7} {cond:<9} {med['push_s']:>7.3f} {med['raw_s']:>6.3f} {med['transfer_s']:>10.3f} "
                         f"{med['commit_s'] * 1e3:>9.1f} {med['pause_s'] * 1e3:>8.1f} {over * 1e3:>15.1f} "
                         f"{nbytes / med['push_s'] / 1e9:>5.2f} {vs_raw:>6.2f}")
            verdicts.append(f"{engine} {cond}: pause - commit {over * 1e3:.1f} ms (goal <= "
                            f"{TARGET_PAUSE_OVER_COMMIT_S * 1e3:.0f}: {'ok' if over <= TARGET_PAUSE_OVER_COMMIT_S else 'MISSED'}); "
                            f"bytes/s {vs_raw:.2f} of raw (goal >= {TARGET_VS_RAW}: "
                            f"{'ok' if vs_raw >= TARGET_VS_RAW else 'MISSED'})")
    return "\n".join(lines + [""] + verdicts)


def main(argv: list[str] | None = None) -> None:
    from engine.models.model_names import MODEL_HELP

    p = argparse.ArgumentParser(prog="python -m bench.vllm_push", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: smollm2; tiny with --quick)")
    p.add_argument("--engines", default="vllm,native", help="sidecar engines, in order (default: vllm,native)")
    p.add_argument("--pushes", type=int, default=None, help="timed pushes per engine and load (default: 5; --quick: 2)")
    p.add_argument("--no-flatten", action="store_true",
                   help="push from the trainer's own parameters (default: flattened first, "
                        "weight_sync.flatten_parameters, as the recipes do on CPU)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 pushes")
    p.add_argument("--no-vllm-cpu-setup", action="store_true",
                   help="run without vLLM's documented CPU set-up (bench/vllm_cpu_setup.py): its figures then are "
                        "not its users'")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench import vllm_cpu_setup

    setup = vllm_cpu_setup.apply("bench.vllm_push", argv, enabled=not args.no_vllm_cpu_setup)
    logging.getLogger("weight_sync").setLevel(logging.WARNING)
    from engine.vllm_start import apply_env_defaults

    apply_env_defaults("cpu", 1, "WARNING")  # the vLLM sidecar inherits them; it would set them itself too
    from transformers import AutoModelForCausalLM

    from engine.models.model_names import resolve_model_arg
    from engine.model_runner import available_cpus
    from rollout.launcher import LocalSidecar
    from weight_sync import flatten_parameters

    torch.set_num_threads(available_cpus())
    model_dir = resolve_model_arg(args.model or ("tiny" if args.quick else "smollm2"))
    pushes = args.pushes or (2 if args.quick else 5)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if not args.no_flatten:
        flatten_parameters(trainer)
    nbytes = sum(t.numel() * t.element_size() for t in trainer.parameters())
    log.info("model %s: %.1f MB fp32; raw baseline engine starting", model_dir, nbytes / 1e6)
    results, version = {}, 0

    async def run_all():
        nonlocal version
        raw = RawBroadcast(model_dir, nbytes)
        try:
            await raw.start()
            for engine in [e for e in args.engines.split(",") if e]:
                log.info("sidecar --engine %s: starting", engine)
                side = LocalSidecar(model_dir, "--engine", engine, "--max-model-len", "256", "--stats-interval", "0",
                                    "--log-level", "WARNING", "--host-copy", "off", "--warm-standby", "off",
                                    timeout_s=900.0)
                try:
                    results[engine], version = await measure(side.url, trainer, raw, pushes, version)
                finally:
                    side.stop()
        finally:
            raw.close()

    t0 = time.perf_counter()
    asyncio.run(run_all())
    print(f"\npushes: {os.path.basename(model_dir.rstrip('/'))}, {nbytes / 1e6:.0f} MB fp32, gloo on loopback, "
          f"trainer {'not ' if args.no_flatten else ''}flattened, overlapped receive (the default), median of {pushes} "
          f"per row, torch {torch.__version__}, {available_cpus()} CPUs; {time.perf_counter() - t0:.0f} s in all\n{setup}")
    print(report(results, nbytes))


if __name__ == "__main__":
    main()
