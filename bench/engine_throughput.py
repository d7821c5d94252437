"""Engine throughput on an RL-shaped workload, against HF `generate` and HF continuous batching.

The workload is a GRPO-style rollout batch: P prompts x n samples, random prompt token ids of
uniformly drawn lengths, a uniformly drawn `max_tokens` per request, temperature 1 and EOS
ignored, so every system generates exactly the requested number of tokens and the counts
compare. In one run it times, each after a short warm-up:

  (a) this engine: `LLM.generate` on the whole workload;
  (b) HF `model.generate` on left-padded batches of prompts (num_return_sequences=n). It takes
      one max_new_tokens per batch, so a batch runs to its longest request and only each
      request's own max_tokens count as useful output tokens;
  (c) transformers' continuous batching, i.e. the manager behind `model.generate_batch`, fed
      request by request so each gets its own max_new_tokens (`generate_batch` itself takes
      only one), n via num_return_sequences.

It prints output tokens/s, the ratios against the targets, and the engine's efficiency (time
inside the model forward / total generate time). `--profile` adds a breakdown of where the
engine's time goes. Run from the repository root:

    python -m bench.engine_throughput            # the full default workload (~10 min on 2 cores)
    python -m bench.engine_throughput --quick    # smoke test on the tiny model
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger("bench.engine_throughput")

TARGET_VS_GENERATE = 3.0
TARGET_VS_GENERATE_BATCH = 5.0
TARGET_EFFICIENCY = 0.85
FIRST_TOKEN_ID = 3  # ids 0..2 are the tiny models' special tokens (eos, pad, bos)


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]  # per request; each of its n samples generates exactly this many
    n: int

    def head(self, num_prompts: int) -> "Workload":
        return Workload(self.prompts[:num_prompts], self.max_tokens[:num_prompts], self.n)

    @property
    def num_seqs(self) -> int:
        return len(self.prompts) * self.n

    @property
    def useful_tokens(self) -> int:
        return self.n * sum(self.max_tokens)


def make_workload(
    vocab_size: int, num_prompts: int, n: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int], seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(rng.randint(*prompt_len))] for _ in range(num_prompts)
    ]
    return Workload(prompts, [rng.randint(*max_tokens) for _ in range(num_prompts)], n)


@dataclass
class Result:
    name: str
    short: str  # name in the ratio lines
    num_seqs: int
    useful_tokens: int  # what the workload asked for
    generated_tokens: int  # what the system computed (more than useful for padded HF generate)
    seconds: float
    extra: dict = field(default_factory=dict)
    probe: tuple[float, float] = (0.0, 0.0)  # machine GFLOP/s before and after the run

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def probe_gflops(reps: int = 20) -> float:
    """fp32 matmul speed right now, in GFLOP/s, at the small model's MLP shape. The cores may be
    shared (in the 2-core sandbox, with other sessions' test suites and benchmarks, which cut this
    to ~40 from ~200), so each system's run is bracketed by a probe. A bracket cannot see a slow
    spell in the middle of a run, but low probes flag a run that does not compare."""
    a, b = torch.randn(512, 576), torch.randn(576, 1536)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * 512 * 576 * 1536 * reps / (time.perf_counter() - t0) / 1e9


def probed(run, *args) -> Result:
    before = probe_gflops()
    result = run(*args)
    result.probe = (before, probe_gflops())
    return result


# -- (a) this engine ------------------------------------------------------------------------------


def engine_params(wl: Workload, seed: int):
    from engine import SamplingParams

    # Per-request seeds, as a reproducible RL rollout would use; sample i of n uses seed + i.
    return [
        SamplingParams(n=wl.n, temperature=1.0, max_tokens=k, ignore_eos=True, seed=seed * 1_000_003 + i * wl.n)
        for i, k in enumerate(wl.max_tokens)
    ]


def seeded_params(wl: Workload):
    """The workload's sampling params with one seed per request (request i: seed i)."""
    from engine import SamplingParams

    return [SamplingParams(n=wl.n, temperature=1.0, max_tokens=m, ignore_eos=True, seed=i)
            for i, m in enumerate(wl.max_tokens)]


def make_engine(model_dir: str, max_model_len: int, max_num_seqs: int, seed: int):
    from engine import LLM, EngineConfig

    cfg = EngineConfig(
        model=model_dir, device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, seed=seed, num_threads=torch.get_num_threads(),
    )
    return LLM(cfg)


def run_engine(llm, wl: Workload, warmup: Workload, seed: int) -> Result:
    llm.generate(warmup.prompts, engine_params(warmup, seed + 1), use_tqdm=False)
    llm.core.reset_prefix_cache()  # the timed run starts cold (the warm-up prompts differ anyway)
    before = llm.core.stats()
    llm.core.runner.forward_seconds = 0.0
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, engine_params(wl, seed), use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.core.stats()
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    if generated != wl.useful_tokens:
        log.warning("engine generated %d tokens, the workload asked for %d", generated, wl.useful_tokens)
    extra = {
        "forward_seconds": llm.core.runner.forward_seconds,
        "prefix_cache_hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
        "prefix_cache_query_tokens": after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"],
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
    }
    return Result("engine (LLM)", "engine", wl.num_seqs, wl.useful_tokens, generated, seconds, extra)


# -- (b) HF generate on padded batches ------------------------------------------------------------


def load_hf_model(model_dir: str, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    ).eval()


def hf_generate_batch(model, prompts: list[list[int]], n: int, max_new_tokens: int) -> int:
    """One left-padded `generate` call; returns the number of tokens it generated."""
    from transformers import GenerationConfig

    pad = model.config.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen_cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0,  # plain temperature-1 sampling, as the engine
        num_return_sequences=n, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,  # masks EOS: nothing stops early (the engine's ignore_eos)
        pad_token_id=pad, eos_token_id=model.config.eos_token_id,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
    new = out.shape[1] - width
    if new != max_new_tokens:
        log.warning("HF generate produced %d new tokens, asked for %d", new, max_new_tokens)
    return out.shape[0] * new


def run_hf_generate(model_dir: str, wl: Workload, batch_prompts: int, seed: int, label: str = "") -> Result:
    model = load_hf_model(model_dir, "sdpa")
    hf_generate_batch(model, wl.prompts[:2], wl.n, 4)  # warm-up
    torch.manual_seed(seed)
    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(wl.prompts), batch_prompts):
        batch = wl.prompts[i : i + batch_prompts]
        generated += hf_generate_batch(model, batch, wl.n, max(wl.max_tokens[i : i + batch_prompts]))
        log.info("HF generate: %d/%d prompts, %.1fs", i + len(batch), len(wl.prompts), time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    name = f"HF generate ({batch_prompts} prompts/batch){label}"
    return Result(name, "HF generate", wl.num_seqs, wl.useful_tokens, generated, seconds)


# -- (c) transformers continuous batching ---------------------------------------------------------


def cb_session(model, wl: Workload, seed: int) -> tuple[float, int]:
    """One continuous-batching session; returns (seconds from first request to last result, tokens).

    This is `generate_batch`'s own loop, except that each request is added with its own
    max_new_tokens. The manager's warm-up and thread start happen before the clock starts."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=wl.n,
        max_new_tokens=max(wl.max_tokens), eos_token_id=-1,  # -1: no EOS (the engine's ignore_eos)
        pad_token_id=model.config.pad_token_id,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in wl.prompts), max_generated_length=max(wl.max_tokens),
        num_requests=wl.num_seqs,
    )
    cb_cfg = ContinuousBatchingConfig(seed=seed)
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, workload_hints=hints, block=True, timeout=30
    ) as manager:
        t0 = time.perf_counter()
        for prompt, k in zip(wl.prompts, wl.max_tokens):
            manager.add_request(prompt, max_new_tokens=k)
        while len(results) < wl.num_seqs:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("the continuous batching thread died")
        seconds = time.perf_counter() - t0
    errors = [r.error for r in results.values() if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} continuous batching requests failed: {errors[0]}")
    return seconds, sum(len(r.generated_tokens) for r in results.values())


def run_generate_batch(model_dir: str, wl: Workload, warmup: Workload, seed: int, label: str = "") -> Result:
    # CPU has no flash attention: "sdpa" and "paged|eager" are the implementations it accepts.
    model = load_hf_model(model_dir, "sdpa")
    cb_session(model, warmup, seed + 1)
    seconds, generated = cb_session(model, wl, seed)
    if generated != wl.useful_tokens:
        log.warning("generate_batch generated %d tokens, the workload asked for %d", generated, wl.useful_tokens)
    name = f"HF continuous batching{label}"
    return Result(name, "HF continuous batching", wl.num_seqs, wl.useful_tokens, generated, seconds)


# -- engine profile (--profile) --------------------------------------------------------------------


class StageTimer:
    """Wraps callables to accumulate their wall time by stage name."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

        return timed


def profile_engine(llm, wl: Workload, seed: int) -> None:
    """Re-run the workload with the engine's stages timed (by wrapping them here, the engine is
    untouched) and under the torch profiler; print the split and the top aten ops."""
    from transformers import AttentionInterface

    from engine.models import attention

    core, runner = llm.core, llm.core.runner
    timer = StageTimer()
    patched = {
        (core.scheduler, "schedule"): "schedule",
        (runner, "_prepare_prefill"): "prepare inputs",
        (runner, "_prepare_decode"): "prepare inputs",
        (runner, "sample"): "sample",
    }
    for (obj, attr), stage in patched.items():
        setattr(obj, attr, timer.wrap(stage, getattr(obj, attr)))
    AttentionInterface.register(attention.ATTN_NAME, timer.wrap("attention", attention.paged_attention))
    core.reset_prefix_cache()
    runner.forward_seconds = 0.0
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            llm.generate(wl.prompts, engine_params(wl, seed), use_tqdm=False)
            total = time.perf_counter() - t0
    finally:
        for obj, attr in patched:
            delattr(obj, attr)  # drop the instance attribute: the class method shows through again
        AttentionInterface.register(attention.ATTN_NAME, attention.paged_attention)
    s = timer.seconds
    forward = runner.forward_seconds
    outside_forward = sum(v for k, v in s.items() if k != "attention")  # attention runs inside the forward
    rows = [
        ("model forward, attention fn (KV write, gather, SDPA)", s.get("attention", 0.0)),
        ("model forward, rest (matmuls, norms, RoPE, mask, lm_head)", forward - s.get("attention", 0.0)),
        ("sample", s.get("sample", 0.0)),
        ("prepare inputs", s.get("prepare inputs", 0.0)),
        ("schedule", s.get("schedule", 0.0)),
        ("other Python (stop checks, deltas, outputs)", total - forward - outside_forward),
    ]
    print(f"\nengine profile ({total:.1f}s under the profiler; shares of that wall time)")
    for name, sec in rows:
        print(f"  {name:<58} {sec:8.2f}s {sec / total:6.1%}")
    print("\ntop aten ops by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


# -- report ---------------------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return "ok" if value >= target else "MISSED"


def report(title: str, results: list[Result], notes: list[str]) -> None:
    print(f"\n{title}")
    print(f"{'system':<48} {'seqs':>5} {'useful tok':>10} {'computed':>9} {'seconds':>8} {'tok/s':>8} "
          f"{'probe GFLOP/s':>14}")
    for r in results:
        print(f"{r.name:<48} {r.num_seqs:>5} {r.useful_tokens:>10} {r.generated_tokens:>9} {r.seconds:>8.1f} "
              f"{r.tokens_per_s:>8.1f} {r.probe[0]:>6.0f} / {r.probe[1]:<5.0f}")
    ours = results[0]
    targets = {"HF generate": TARGET_VS_GENERATE, "HF continuous batching": TARGET_VS_GENERATE_BATCH}
    print()
    for r in results[1:]:
        ratio, target = ours.tokens_per_s / r.tokens_per_s, targets[r.short]
        print(f"{'ours / ' + r.short:<48} {ratio:6.2f}x   target >= {target:g}x   {verdict(ratio, target)}")
    eff = ours.extra["forward_seconds"] / ours.seconds
    print(f"{'engine efficiency (forward / total)':<48} {eff:6.2f}    target >= {TARGET_EFFICIENCY:g}    "
          f"{verdict(eff, TARGET_EFFICIENCY)}")
    e = ours.extra
    print(f"engine: prefix cache served {e['prefix_cache_hit_tokens']} of {e['prefix_cache_query_tokens']} prompt "
          f"tokens, {e['num_preemptions']} preemptions")
    for note in notes:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> None:
    from engine.models.model_names import MODEL_HELP

    p = argparse.ArgumentParser(
        description="Engine throughput on an RL-shaped workload (P prompts x n samples, temperature 1, EOS "
        "ignored) against HF generate and HF continuous batching, on the CPU.",
    )
    # Workload flags default to None: the full default or, with --quick, the smoke-test value.
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: small; tiny with --quick)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts in the workload (default: 64; --quick: 8)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default: 8; --quick: 4)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="prompt lengths, drawn uniformly (default: 16 128)")
    p.add_argument("--max-tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="per-request max_tokens, drawn uniformly (default: 16 128; --quick: 8 32)")
    p.add_argument("--max-num-seqs", type=int, default=512,
                   help="engine running-batch size (default: 512, the whole default workload at once)")
    p.add_argument("--hf-batch-prompts", type=int, default=None,
                   help="prompts per HF generate call, n sequences each (default: 8; --quick: 4)")
    p.add_argument("--generate-prompts", type=int, default=None,
                   help="time HF generate on the first this many prompts only (default: 16, i.e. 2 batches; "
                   "--quick: all). Its batches are independent, so a subset's tokens/s stands for the whole")
    p.add_argument("--cb-prompts", type=int, default=None,
                   help="time HF continuous batching on the first this many prompts only (default: all). Its "
                   "cost per token grows with the number of requests running at once, so a subset flatters it")
    p.add_argument("--skip-generate", action="store_true", help="do not run HF generate")
    p.add_argument("--skip-generate-batch", action="store_true", help="do not run HF continuous batching")
    p.add_argument("--profile", action="store_true",
                   help="after the timed run, profile the engine on the same workload (stage split, top aten ops)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, 8 prompts x n=4, max_tokens 8-32")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and of the samplers (default: 0)")
    args = p.parse_args(argv)
    defaults = {
        "num_prompts": 64, "n": 8, "prompt_len": (16, 128), "max_tokens": (16, 128), "hf_batch_prompts": 8,
        "generate_prompts": 16,  # all 8 batches would add ~2 minutes to a ~9.5-minute run
    }
    if args.quick:
        defaults.update(num_prompts=8, n=4, max_tokens=(8, 32), hf_batch_prompts=4, generate_prompts=8)
    for dest, value in defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "ContinuousBatchingLogger"):  # CB logs every session at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from engine.model_runner import available_cpus

    threads = available_cpus()
    torch.set_num_threads(threads)

    from transformers import AutoConfig

    from engine.models.model_names import resolve_model_arg

    size = "tiny" if args.quick else "small"
    model_dir = resolve_model_arg(args.model or size)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    wl = make_workload(vocab, args.num_prompts, args.n, tuple(args.prompt_len), tuple(args.max_tokens), args.seed)
    # Warm-up workload: other prompts, same shape, a few short requests.
    warm = make_workload(vocab, 4, args.n, tuple(args.prompt_len), (4, 8), args.seed + 1)
    notes = []

    def subset(num_prompts: int | None, why: str) -> tuple[Workload, str]:
        if num_prompts is None or num_prompts >= len(wl.prompts):
            return wl, ""
        notes.append(
            f"{why} ran on the first {num_prompts} of the {len(wl.prompts)} prompts; tokens/s compare as rates"
        )
        return wl.head(num_prompts), f", first {num_prompts} prompts"

    log.info("model %s, %d threads; workload %d prompts x n=%d = %d sequences, %d output tokens",
             model_dir, threads, len(wl.prompts), wl.n, wl.num_seqs, wl.useful_tokens)
    results = []
    log.info("engine: loading and warming up")
    llm = make_engine(model_dir, args.prompt_len[1] + args.max_tokens[1], args.max_num_seqs, args.seed)
    num_params = sum(t.numel() for t in llm.core.runner.model.parameters())
    results.append(probed(run_engine, llm, wl, warm, args.seed))
    log.info("engine: %.1f tokens/s", results[-1].tokens_per_s)
    if not args.profile:
        del llm
        gc.collect()  # free the engine's KV cache before the baselines load their models

    if not args.skip_generate:
        log.info("HF generate: loading and warming up")
        gen_wl, label = subset(args.generate_prompts, "HF generate")
        results.append(probed(run_hf_generate, model_dir, gen_wl, args.hf_batch_prompts, args.seed, label))
        log.info("HF generate: %.1f tokens/s", results[-1].tokens_per_s)
    if not args.skip_generate_batch:
        log.info("HF continuous batching: loading and warming up")
        cb_wl, label = subset(args.cb_prompts, "HF continuous batching")
        results.append(probed(run_generate_batch, model_dir, cb_wl, warm, args.seed, label))
        log.info("HF continuous batching: %.1f tokens/s", results[-1].tokens_per_s)

    import transformers

    title = (
        f"engine throughput: {os.path.basename(model_dir.rstrip('/'))} ({num_params / 1e6:.1f}M params, fp32, CPU, "
        f"{threads} threads, torch {torch.__version__}, transformers {transformers.__version__})\n"
        f"workload: {len(wl.prompts)} prompts x n={wl.n}, prompt len {args.prompt_len[0]}-{args.prompt_len[1]}, "
        f"max_tokens {args.max_tokens[0]}-{args.max_tokens[1]}, temperature 1, ignore_eos, seed {args.seed}; "
        f"engine max_num_seqs={args.max_num_seqs}"
    )
    report(title, results, notes)
    if args.profile:  # after the timed runs, so the profiler cannot perturb them
        profile_engine(llm, wl, args.seed)


if __name__ == "__main__":
    main()
