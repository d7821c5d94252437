"""The sidecar against the in-process engine, and what a weight push costs the rollouts.

In one run:
  (a) rollout tokens/s through `python -m rollout.serve` + `RolloutClient` vs the in-process
      `LLM` on the same RL-shaped workload (target: ratio >= 0.9);
  (b) per push of the model's weights while rollouts are decoding (pause mode "keep"): total
      push seconds as the trainer sees them, transfer seconds (workers' receive), and the stall:
      the sidecar's pause window (engines stopped -> resumed; `--overlap-receive off`, the
      pause-for-transfer path: bench.overlap compares it with the default) minus the transfer
      (target: <= 50 ms). The first token after resume follows within one decode step.

    python -m bench.sidecar            # small model (~50M), 32 prompts x 8
    python -m bench.sidecar --quick    # tiny model smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

import torch

from bench.engine_throughput import make_workload, seeded_params
from engine.model_runner import available_cpus

log = logging.getLogger("bench.sidecar")
TARGET_RATIO = 0.9
TARGET_STALL_MS = 50.0


def llm_tokens_per_s(model: str, workload, max_num_seqs: int) -> float:
    from engine import LLM, EngineConfig

    llm = LLM(EngineConfig(model=model, max_num_seqs=max_num_seqs, max_model_len=512))
    llm.generate(workload.prompts[:4], seeded_params(workload)[:4], use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(workload.prompts, seeded_params(workload), use_tqdm=False)
    return workload.useful_tokens / (time.perf_counter() - t0)


async def sidecar_figures(url: str, model: str, workload, pushes: int) -> dict:
    from transformers import AutoModelForCausalLM

    from engine import SamplingParams
    from rollout import AsyncRolloutClient

    client = AsyncRolloutClient(url)
    await client.generate(workload.prompts[:4], seeded_params(workload)[:4])  # warm-up
    t0 = time.perf_counter()
    groups = await client.generate(workload.prompts, seeded_params(workload))
    tps = sum(len(r.token_ids) for g in groups for r in g) / (time.perf_counter() - t0)

    trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    await client.init_weight_sync()
    await client.push_weights(trainer, version=1)  # warm-up: first-touch of the staging memory
    long = SamplingParams(n=8, temperature=1.0, max_tokens=100000, ignore_eos=True)
    load = asyncio.ensure_future(client.generate([[5 + i, 6, 7, 8] for i in range(8)], long))
    await asyncio.sleep(1.0)
    rows = []
    for k in range(pushes):
        before = (await client.stats())[0]
        t = time.perf_counter()
        out = await client.push_weights(trainer, version=2 + k, pause_mode="keep")
        total = time.perf_counter() - t
        after = (await client.stats())[0]
        side = out["sidecars"][0]
        pause = after["pause_seconds"] - before["pause_seconds"]
        rows.append({"total": total, "transfer": side["transfer_seconds"], "pause": pause,
                     "stall_minus_transfer": pause - side["transfer_seconds"]})
        await asyncio.sleep(0.3)
    load.cancel()
    await asyncio.gather(load, return_exceptions=True)  # let the cancelled request unwind before the loop goes
    await client.close()
    return {"tps": tps, "pushes": rows, "bytes": sum(p.numel() * 4 for p in trainer.parameters())}


def main(argv: list[str] | None = None) -> None:
    from engine.models.model_names import MODEL_HELP

    p = argparse.ArgumentParser(description="Sidecar vs in-process engine throughput, and the cost of a push.")
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: small; tiny with --quick)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny model, 8 prompts x 4")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(available_cpus())
    from transformers import AutoConfig

    from engine.models.model_names import resolve_model_arg
    from rollout.launcher import LocalSidecar

    size = "tiny" if args.quick else "small"
    model = resolve_model_arg(args.model or size)
    if args.quick:
        args.num_prompts, args.n, args.pushes = 8, 4, 3
    workload = make_workload(AutoConfig.from_pretrained(model).vocab_size, args.num_prompts, args.n, (16, 128),
                             (16, 128), args.seed)
    log.info("timing the in-process LLM")
    llm_tps = llm_tokens_per_s(model, workload, args.max_num_seqs)
    log.info("timing the sidecar")
    # the pause-for-transfer path, whose stall this bench has measured since issue 6; the overlapped
    # receive (the default) is bench.overlap's
    with LocalSidecar(model, "--overlap-receive", "off", "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512",
                      "--log-level", "WARNING", "--stats-interval", "0") as side:
        fig = asyncio.new_event_loop().run_until_complete(sidecar_figures(side.url, model, workload, args.pushes))
    ratio = fig["tps"] / llm_tps
    med = {k: statistics.median(r[k] for r in fig["pushes"]) for k in fig["pushes"][0]}
    print(f"\nworkload: {args.num_prompts} prompts x n={args.n}, {workload.useful_tokens} output tokens, {model}")
    print(f"{'LLM (in-process)':<30}{llm_tps:>10.0f} tok/s")
    print(f"{'sidecar + RolloutClient':<30}{fig['tps']:>10.0f} tok/s")
    print(f"sidecar / LLM: {ratio:.2f}  (target >= {TARGET_RATIO})  {'OK' if ratio >= TARGET_RATIO else 'MISS'}")
    print(f"push of {fig['bytes'] / 1e6:.0f} MB under load (keep), median of {len(fig['pushes'])}: "
          f"total {med['total'] * 1e3:.0f} ms, transfer {med['transfer'] * 1e3:.0f} ms, "
          f"pause window {med['pause'] * 1e3:.0f} ms, stall - transfer {med['stall_minus_transfer'] * 1e3:.1f} ms "
          f"(target <= {TARGET_STALL_MS:.0f} ms)  {'OK' if med['stall_minus_transfer'] * 1e3 <= TARGET_STALL_MS else 'MISS'}")


if __name__ == "__main__":
    main()
