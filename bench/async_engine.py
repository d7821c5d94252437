"""AsyncEngine against the in-process LLM, and the latency of pause(keep) + resume under load.

In one run:
  (a) output tokens/s of `AsyncEngine` (core in its own process, every request a concurrent
      `generate`) vs the in-process `LLM` on the engine benchmark's RL-shaped workload
      (target: ratio >= 0.9);
  (b) with 64 requests decoding, the wall time of `pause_generation(mode="keep")` +
      `resume_generation()` as the caller sees it, repeated (target: p50 <= 20 ms on CPU).

    python -m bench.async_engine            # small model, 64 prompts x 8 (several minutes)
    python -m bench.async_engine --quick    # smoke test on the tiny model
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

log = logging.getLogger("bench.async_engine")

TARGET_RATIO = 0.9
TARGET_PAUSE_P50_MS = 20.0


def run_llm(cfg, workload) -> float:
    from engine import LLM

    llm = LLM(cfg)
    llm.generate(workload.prompts[:4], seeded_params(workload)[:4], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(workload.prompts, seeded_params(workload), use_tqdm=False)
    return workload.useful_tokens / (time.perf_counter() - t0)


async def _drain(engine, prompt, params, rid):
    out = None
    async for out in engine.generate(prompt, params, request_id=rid):
        pass
    return out


async def run_async(engine, workload) -> float:
    params = seeded_params(workload)
    await asyncio.gather(*[_drain(engine, p, s, f"w{i}") for i, (p, s) in enumerate(zip(workload.prompts[:4],
                                                                                        params[:4]))])
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[_drain(engine, p, s, f"r{i}") for i, (p, s) in enumerate(zip(workload.prompts,
                                                                                            params))])
    dt = time.perf_counter() - t0
    got = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert got == workload.useful_tokens, (got, workload.useful_tokens)
    return got / dt


async def pause_latency(engine, num_requests: int, repeats: int) -> list[float]:
    from engine import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=100000, ignore_eos=True)
    prompts = [[3 + i, 4 + i, 5 + i, 6 + i] for i in range(num_requests)]
    tasks = [asyncio.ensure_future(_drain(engine, p, params, f"p{i}")) for i, p in enumerate(prompts)]
    while sum(bool(c.state.outputs[0].token_ids) for c in engine.requests.values()) < num_requests:
        await asyncio.sleep(0.01)
    times = []
    for _ in range(repeats):
        await asyncio.sleep(0.05)  # let decoding run between pauses
        t0 = time.perf_counter()
        await engine.pause_generation(mode="keep", clear_cache=False)
        await engine.resume_generation()
        times.append((time.perf_counter() - t0) * 1000)
    stats = await engine.get_stats()
    assert stats["num_running"] == num_requests, stats
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return times


def main(argv: list[str] | None = None) -> None:
    from engine.models.model_names import MODEL_HELP

    p = argparse.ArgumentParser(description="AsyncEngine vs in-process LLM throughput, and pause/resume latency.")
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: small; tiny with --quick)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--pause-requests", type=int, default=64, help="requests decoding during the pause test")
    p.add_argument("--pause-repeats", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="tiny model, 8 prompts x 4: a smoke test")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(available_cpus())

    from engine import AsyncEngine, EngineConfig
    from engine.models.model_names import resolve_model_arg

    size = "tiny" if args.quick else "small"
    model = resolve_model_arg(args.model or size)
    if args.quick:
        args.num_prompts, args.n, args.pause_repeats = 8, 4, 10
    cfg = EngineConfig(model=model, max_num_seqs=args.max_num_seqs, max_model_len=512, seed=args.seed)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    workload = make_workload(vocab, args.num_prompts, args.n, (16, 128), (16, 128), args.seed)

    log.info("timing the in-process LLM")
    llm_tps = run_llm(cfg, workload)
    log.info("timing AsyncEngine")
    engine = AsyncEngine(cfg)
    loop = asyncio.new_event_loop()
    try:
        async_tps = loop.run_until_complete(run_async(engine, workload))
        log.info("timing pause(keep) + resume with %d requests decoding", args.pause_requests)
        times = loop.run_until_complete(pause_latency(engine, args.pause_requests, args.pause_repeats))
    finally:
        engine.shutdown()
        loop.close()

    ratio = async_tps / llm_tps
    p50, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
    print(f"\nworkload: {args.num_prompts} prompts x n={args.n}, {workload.useful_tokens} output tokens, {model}")
    print(f"{'LLM (in-process)':<28}{llm_tps:>10.0f} tok/s")
    print(f"{'AsyncEngine (core process)':<28}{async_tps:>10.0f} tok/s")
    print(f"AsyncEngine / LLM: {ratio:.2f}  (target >= {TARGET_RATIO})  {'OK' if ratio >= TARGET_RATIO else 'MISS'}")
    print(f"pause(keep)+resume with {args.pause_requests} running: p50 {p50:.1f} ms, p90 {p90:.1f} ms, "
          f"max {max(times):.1f} ms  (target p50 <= {TARGET_PAUSE_P50_MS:.0f} ms)  "
          f"{'OK' if p50 <= TARGET_PAUSE_P50_MS else 'MISS'}")


if __name__ == "__main__":
    main()
