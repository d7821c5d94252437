"""Rollouts through the OpenAI-compatible HTTP front against the ZMQ client, on one sidecar.

The workload: P prompts of random token ids (16-64 tokens), one completion of exactly
`--max-tokens` tokens each (EOS ignored, temperature 1, a seed per request), all in flight at
once. The same workload runs, alternately and `--repeats` times each:

  zmq      RolloutClient.generate of every prompt in one call (the trainer's path);
  http     one /v1/completions request per prompt, from `--clients` AsyncOpenAI clients at once;
  stream   the same requests with stream=True; each request's time to first token is recorded;
  raw      the same stream read with httpx and json.loads (a light client: what the server costs
           without the openai client's per-event pydantic objects competing for the cores).

It prints tokens/s for each (medians), HTTP/ZMQ ratios (goal >= 0.8), p50/p99 time to first
token, and the engine's FLOP/s as a fraction of the matmul peak probed on this machine.

    python -m bench.http                   # tiny model (the HTTP overhead's worst case)
    python -m bench.http --model small     # 52M parameters
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import time

log = logging.getLogger("bench.http")

GOAL = 0.8


def workload(vocab: int, prompts: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(prompts)]


def run_zmq(client, prompts, max_tokens: int) -> float:
    from engine import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    groups = client.generate(prompts, params)
    seconds = time.perf_counter() - t0
    assert sum(len(g[0].token_ids) for g in groups) == len(prompts) * max_tokens
    return seconds


async def run_http(base_url: str, token: str, model: str, prompts, max_tokens: int, clients: int,
                   stream: bool, raw: bool = False) -> tuple[float, list[float]]:
    """Wall seconds for every request, and each streamed request's time to first token. `raw`:
    streamed with httpx and json.loads per event instead of the openai client (which builds a
    pydantic object per event: on 2 shared cores the clients' own parsing is much of the cost)."""
    import openai

    pool = [openai.AsyncOpenAI(base_url=base_url, api_key=token or "none", max_retries=0, timeout=600)
            for _ in range(clients)]
    ttft: list[float] = []

    async def one(i: int, p: list[int]) -> int:
        c = pool[i % clients]
        kw = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 1.0, "seed": i,
              "extra_body": {"ignore_eos": True}}
        sent = time.perf_counter()
        if raw:
            return await _raw_stream(c, kw, sent, ttft)
        if not stream:
            return len((await c.completions.create(**kw)).choices[0].token_ids)
        n = 0
        async for chunk in await c.completions.create(stream=True, **kw):
            k = len(chunk.choices[0].token_ids) if chunk.choices else 0
            if k and not n:
                ttft.append(time.perf_counter() - sent)
            n += k
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - t0
    for c in pool:
        await c.close()
    assert sum(counts) == len(prompts) * max_tokens, counts
    return seconds, ttft


async def _raw_stream(c, kw: dict, sent: float, ttft: list[float]) -> int:
    import json

    body = {k: v for k, v in kw.items() if k != "extra_body"} | kw["extra_body"] | {"stream": True}
    n = 0
    async with c._client.stream("POST", str(c.base_url) + "completions", json=body,
                                headers={"Authorization": f"Bearer {c.api_key}"}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            k = len(choices[0]["token_ids"]) if choices else 0
            if k and not n:
                ttft.append(time.perf_counter() - sent)
            n += k
    return n


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.http", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a model directory or name (tiny, small, smollm2)")
    p.add_argument("--prompts", type=int, default=64, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=8, help="AsyncOpenAI clients sharing the requests")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):  # a line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers import AutoConfig

    from bench.engine_throughput import probe_gflops
    from engine.models.model_names import resolve_model_arg
    from rollout import RolloutClient
    from rollout.launcher import LocalSidecar

    model_dir = resolve_model_arg(args.model)
    cfg = AutoConfig.from_pretrained(model_dir)
    prompts = workload(cfg.vocab_size, args.prompts, seed=0)
    token = "bench-http"
    sidecar = LocalSidecar(model_dir, "--http-port", "0", "--served-model-name", "m", "--stats-interval", "0",
                           "--log-level", "WARNING", "--max-num-seqs", str(max(64, args.prompts)), token=token)
    client = RolloutClient(sidecar.url, token=token)
    base = sidecar.http_url + "/v1"
    seconds = {"zmq": [], "http": [], "stream": [], "raw": []}
    ttfts: list[float] = []
    raw_ttfts: list[float] = []
    probes = []
    try:
        # warm-up, the whole workload once each: the engine's first steps, the HTTP stack's imports
        run_zmq(client, prompts, args.max_tokens)
        asyncio.run(run_http(base, token, "m", prompts, args.max_tokens, args.clients, True))
        for r in range(args.repeats):
            probes.append(probe_gflops())
            seconds["zmq"].append(run_zmq(client, prompts, args.max_tokens))
            seconds["http"].append(asyncio.run(run_http(base, token, "m", prompts, args.max_tokens, args.clients,
                                                        False))[0])
            s, t = asyncio.run(run_http(base, token, "m", prompts, args.max_tokens, args.clients, True))
            seconds["stream"].append(s)
            ttfts += t
            s, t = asyncio.run(run_http(base, token, "m", prompts, args.max_tokens, args.clients, True, raw=True))
            seconds["raw"].append(s)
            raw_ttfts += t
            log.info("repeat %d: zmq %.2f s, http %.2f s, stream %.2f s, raw stream %.2f s", r, seconds["zmq"][-1],
                     seconds["http"][-1], seconds["stream"][-1], seconds["raw"][-1])
        probes.append(probe_gflops())
    finally:
        client.close()
        sidecar.stop()
    tokens = args.prompts * args.max_tokens
    rate = {k: tokens / statistics.median(v) for k, v in seconds.items()}
    n_params = _count_params(model_dir)
    peak = statistics.median(probes)
    print(f"\nmodel {args.model} ({n_params / 1e6:.1f}M parameters), {args.prompts} requests x {args.max_tokens} "
          f"tokens, {args.clients} openai clients, {args.repeats} repeats (medians); matmul probe {peak:.0f} GFLOP/s")
    print(f"{'path':8} {'tok/s':>8} {'vs zmq':>7} {'of peak':>8}")
    for k in ("zmq", "http", "stream", "raw"):
        print(f"{k:8} {rate[k]:8.0f} {rate[k] / rate['zmq']:7.2f} {2 * n_params * rate[k] / 1e9 / peak:8.3f}")
    for name, xs in (("stream", ttfts), ("raw stream", raw_ttfts)):
        print(f"time to first token ({name}, {len(xs)} requests): p50 {percentile(xs, 0.5) * 1e3:.0f} ms, "
              f"p99 {percentile(xs, 0.99) * 1e3:.0f} ms")
    print(f"goal: http and stream >= {GOAL} of zmq")


def _count_params(model_dir: str) -> int:
    """Parameters in the checkpoint's safetensors (a tied embedding once): 2 x this FLOPs a token."""
    from pathlib import Path

    from safetensors import safe_open

    n = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                count = 1
                for d in sf.get_slice(name).get_shape():
                    count *= d
                n += count
    return n


if __name__ == "__main__":
    main()
