"""Sampler cost per decode step at real vocabulary sizes: ours (inverse-CDF from one uniform per
row; an RL step's common case in one C call, engine/kernels/native_sampler.py) against the same in torch ops
(what it ran before, and runs on a GPU) and two anchors, in one run:

  exp-race:    the sampler this project had before (argmax(p / E) with one Exp(1) draw per
               vocabulary entry per row, seeded rows from their own generators): O(B x V) draws;
  multinomial: what HF `generate` does (softmax, then torch.multinomial).

Each case samples B rows of V logits at temperature 1, half the rows seeded (per-request
generators, as GRPO groups with seeds), and reports ms per step and ours / anchor. The engine's
own share of a step on a real model is in `python -m bench.engine_throughput --profile`.

    python -m bench.sampler                      # vocab 49152 (SmolLM2) and 151936 (Qwen), B 64 and 256
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np
import torch

from engine.sampler import SamplingTensors, counter_uniforms, sample, sample_with_torch, uniform_noise

log = logging.getLogger("bench.sampler")


def exp_race(logits: torch.Tensor, generators: list, shared: torch.Generator) -> torch.Tensor:
    """The previous sampler, kept here as the anchor: processed log-softmax, Exp(1) noise per
    entry (seeded rows from their own generator), argmax(p / E), and the token's logprob."""
    logits = logits.float()  # bf16 logits too: sampled in fp32, as HF's generate does
    raw = torch.log_softmax(logits, dim=-1)
    processed = torch.log_softmax(logits, dim=-1)
    noise = torch.empty_like(logits)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    noise[unseeded] = torch.empty(len(unseeded), logits.shape[-1]).exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    tokens = (processed.exp() / noise).argmax(dim=-1)
    return tokens, raw.gather(-1, tokens.unsqueeze(-1))


def ours(logits: torch.Tensor, generators: list, shared: torch.Generator, how=sample) -> torch.Tensor:
    rows = logits.shape[0]
    u = uniform_noise(shared, rows, "cpu")
    seeded = torch.tensor([g is not None for g in generators])
    if seeded.any():  # the engine's seeded rows: a counter-based draw from (seed, position)
        drawn = counter_uniforms(np.arange(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64))
        u = torch.where(seeded, torch.from_numpy(drawn), u)
    t = SamplingTensors(torch.ones(rows), uniforms=u, any_greedy=False)
    return how(logits, t)[:2]


def ours_torch(logits: torch.Tensor, generators: list, shared: torch.Generator) -> torch.Tensor:
    return ours(logits, generators, shared, how=sample_with_torch)


def multinomial(logits: torch.Tensor, generators: list, shared: torch.Generator) -> torch.Tensor:
    probs = torch.softmax(logits.float(), dim=-1)
    tokens = torch.multinomial(probs, 1, generator=shared).squeeze(-1)
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).log()


def time_ms(fn, logits, generators, shared, reps: int) -> float:
    fn(logits, generators, shared)  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(logits, generators, shared)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def parse_cases(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """The sampler benches' flags (vocabularies, batches, repetitions); torch on every CPU."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default="49152,151936", help="vocabulary sizes (default: SmolLM2's, Qwen's)")
    p.add_argument("--batches", default="64,256", help="rows per step (default: 64,256)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per case (median reported)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.model_runner import available_cpus

    torch.set_num_threads(available_cpus())
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_cases(__doc__, argv)
    print(f"\nsampler ms per step, torch {torch.__version__}, {torch.get_num_threads()} threads, half the rows seeded")
    print(f"{'vocab':>8}{'batch':>7}{'dtype':>10}{'ours':>9}{'torch ops':>10}{'exp-race':>10}{'multinom':>10}"
          f"{'ours/torch ops':>16}{'ours/exp-race':>15}{'ours/multinom':>15}")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            for dtype in (torch.float32, torch.bfloat16):  # the fp32 and the bf16 engines' logits
                logits = (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab + batch)) * 4).to(dtype)
                shared = torch.Generator().manual_seed(0)
                generators = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(batch)]
                ms = {f.__name__: time_ms(f, logits, generators, shared, args.reps)
                      for f in (ours, ours_torch, exp_race, multinomial)}
                print(f"{vocab:>8}{batch:>7}{str(dtype)[6:]:>10}{ms['ours']:>9.1f}{ms['ours_torch']:>10.1f}"
                      f"{ms['exp_race']:>10.1f}{ms['multinomial']:>10.1f}{ms['ours'] / ms['ours_torch']:>16.2f}"
                      f"{ms['ours'] / ms['exp_race']:>15.2f}{ms['ours'] / ms['multinomial']:>15.2f}")


if __name__ == "__main__":
    main()
