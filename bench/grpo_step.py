"""GRPO, ours against TRL's `GRPOTrainer`: the reward curve of each over several seeds, and the
seconds per step. Same model, task, group size, batch, learning rate, clipping (DAPO's
clip-higher), token-mean loss, advantage epsilon (1e-4) and prompts per step; ours generates on
its sidecar, TRL with HF `generate`.

Two shapes:
  realistic: 8 prompts x 8 completions of up to 64 tokens on the small model (~52M params);
             every seed of --seeds; step-time target: ours <= 0.5x TRL's.
  micro:     1 prompt x 8 completions of up to 8 tokens on the mini model (~1M params), the first
             seed only: shows the fixed overhead of each step (TRL takes about 0.05 s here).

Per shape and system: the reward of each step as mean +- std over the seeds, the mean of the
first and last k steps (per seed, then mean +- std over seeds), and a Welch comparison of the
last-k means (difference, its standard error, t against the 97.5% quantile of Student's t: a
difference with |t| below it is within the seed-to-seed noise). Step time: per seed the median
of ours over the median of TRL's (the first step, a warm-up, not timed), then the median over
seeds; the systems alternate which runs first from seed to seed, so drift in the machine's load
falls on both.

A step is everything between two optimizer steps: generation, rewards, the update and, for us,
the weight push to the sidecar. The sidecar's start is not counted (once per training run).

What still differs from TRL, on purpose: both are seeded, but our engine draws from its own
random streams (the same distribution, not the same draws as HF's sampling); our loss multiplies
in a truncated importance weight exp(trainer logp - engine logp) capped at 2 (≈1 here: the JSON
records its min and max), TRL applies one only with vLLM; TRL left-pads its batches, we
right-pad (RoPE: the same logits up to rounding).

trl is not a dependency of this project; install it only in the benchmark's environment:

    python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0
    .venv-bench/bin/pip install -e . trl==1.16.0
    .venv-bench/bin/python -m bench.grpo_step                  # 3 seeds realistic, 1 micro (~35 min on 2 idle cores)
    .venv-bench/bin/python -m bench.grpo_step --shapes micro   # a minute
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger("bench.grpo_step")

TARGET_RATIO = 0.5
SHAPES = {
    "realistic": {"size": "small", "prompts": 8, "group": 8, "max_tokens": 64, "all_seeds": True},
    "micro": {"size": "mini", "prompts": 1, "group": 8, "max_tokens": 8, "all_seeds": False},
}


def run_ours(model_dir: str, shape: dict, steps: int, lr: float, seed: int, out_dir: Path, task: str,
             data: str | None) -> dict:
    from recipes.rl_train import train

    train("grpo", [
        "--model", model_dir, "--max-steps", str(steps), "--prompts-per-step", str(shape["prompts"]),
        "--group-size", str(shape["group"]), "--max-tokens", str(shape["max_tokens"]), "--lr", str(lr),
        "--seed", str(seed), "--output-dir", str(out_dir), "--report-to", "none", "--log-level", "WARNING",
        "--task", task, *(["--data", data] if data else []),
    ])
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"seed": seed, "step_seconds": [r["timing/step"] for r in rows], "reward": [r["reward"] for r in rows],
            "generate_seconds": [r["timing/generate"] for r in rows],
            "train_seconds": [r["timing/train"] for r in rows],
            "sync_seconds": [r["timing/weight_sync"] for r in rows],
            "is_ratio_min": min(r["sampling/importance_sampling_ratio/min"] for r in rows),
            "is_ratio_max": max(r["sampling/importance_sampling_ratio/max"] for r in rows)}


def run_trl(model_dir: str, shape: dict, steps: int, lr: float, seed: int, out_dir: Path, task: str,
            data: str | None) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from recipes.tasks import make_task

    # AutoTokenizer would swap in Qwen2's own tokenizer class for this model type.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    the_task = make_task(task, tokenizer, data, seed)
    # NOTE: the same seeded draws as our recipe makes, one step's prompts after another; TRL takes
    # them in this order (shuffle_dataset=False), so step i of both trains on the same prompts.
    items = the_task.prompts(shape["prompts"] * (steps + 1))

    def task_reward(prompts, completions, completion_ids, item, **kwargs):
        return [the_task.reward(json.loads(it), ids, text) for it, ids, text in zip(item, completion_ids, completions)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self._t = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._t)

    batch = shape["prompts"] * shape["group"]
    cfg = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=shape["group"], max_completion_length=shape["max_tokens"], temperature=1.0,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", num_iterations=1, seed=seed,
        shuffle_dataset=False, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = StepTimer()
    dataset = Dataset.from_list([{"prompt": it["prompt"], "item": json.dumps(it)} for it in items])
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=cfg, processing_class=tokenizer,
                          train_dataset=dataset, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts on stdout; the rewards are read from log_history
    # Instrumentation only: time TRL's generation (HF generate + scoring) inside its step.
    gen_seconds, generate = [], trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_seconds.append(time.perf_counter() - t)

    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"seed": seed, "step_seconds": timer.seconds, "reward": rewards, "generate_seconds": gen_seconds}


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample std (0 for a single value)."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def t975(df: float) -> float:
    """Student's t 97.5% quantile (two-sided 95%) for real df > 0: bisection on the CDF, the
    density integrated by Simpson's rule (no scipy in the bench venv)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(t, n=2000):
        f = [c * (1 + (t * i / n) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return 0.5 + t / n / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 100.0
    for _ in range(50):
        lo, hi = (lo, (lo + hi) / 2) if cdf((lo + hi) / 2) > 0.975 else ((lo + hi) / 2, hi)
    return (lo + hi) / 2


def welch(a: list[float], b: list[float]) -> dict | None:
    """mean(a) - mean(b), its standard error, Welch's t and degrees of freedom, and whether the
    difference is within the noise (|t| below Student's 97.5% quantile). None with < 2 values."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff, se = statistics.fmean(a) - statistics.fmean(b), (va + vb) ** 0.5
    if se == 0:
        return {"diff": diff, "se": 0.0, "t": None, "df": None, "t_crit": None, "within_noise": diff == 0}
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    crit = t975(df)
    return {"diff": diff, "se": se, "t": diff / se, "df": df, "t_crit": crit, "within_noise": abs(diff / se) < crit}


def reward_stats(runs: list[dict], k: int) -> dict:
    """Per step mean +- std over seeds; first and last k steps, per seed and over seeds."""
    per_step = list(zip(*(r["reward"] for r in runs)))
    first = [statistics.fmean(r["reward"][:k]) for r in runs]
    last = [statistics.fmean(r["reward"][-k:]) for r in runs]
    return {"step_mean": [mean_std(list(s))[0] for s in per_step], "step_std": [mean_std(list(s))[1] for s in per_step],
            "first_k": first, "last_k": last, "first_k_mean_std": mean_std(first), "last_k_mean_std": mean_std(last)}


def summarize(name: str, ours: list[dict], trl: list[dict]) -> dict:
    timed = slice(1, None)  # step 1 is the warm-up

    def med(run, key="step"):
        return statistics.median(run[f"{key}_seconds"][timed])

    k = max(1, min(5, len(ours[0]["reward"]) // 2))
    ratios = [med(o) / med(t) for o, t in zip(ours, trl)]
    o_stats, t_stats = reward_stats(ours, k), reward_stats(trl, k)
    return {"shape": name, "seeds": [r["seed"] for r in ours], "k": k,
            "ours_s": statistics.median(med(o) for o in ours), "trl_s": statistics.median(med(t) for t in trl),
            "ratio": statistics.median(ratios), "ratio_per_seed": ratios,
            "ours_reward": o_stats, "trl_reward": t_stats,
            "last_k_welch": welch(o_stats["last_k"], t_stats["last_k"]),
            "ours_parts": {p: statistics.median(med(o, p) for o in ours) for p in ("generate", "train", "sync")},
            "trl_generate_s": statistics.median(med(t, "generate") for t in trl) if trl[0]["generate_seconds"]
            else None,
            "ours_is_ratio": [min(o["is_ratio_min"] for o in ours), max(o["is_ratio_max"] for o in ours)]}


def plot(results: list[dict], title: str, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        for label, stats in (("ours (sidecar)", r["ours_reward"]), (f"TRL {r['trl_version']}", r["trl_reward"])):
            x = range(1, len(stats["step_mean"]) + 1)
            lo = [m - s for m, s in zip(stats["step_mean"], stats["step_std"])]
            hi = [m + s for m, s in zip(stats["step_mean"], stats["step_std"])]
            line, = ax.plot(x, stats["step_mean"], label=label)
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel(f"mean reward, ± std over {len(r['seeds'])} seed(s)")
        ax.set_title(f"{title}: {r['shape']} ({r['size']}, {r['prompts']} prompts x {r['group']})", fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def report(results: list[dict], header: str) -> None:
    print(f"\n{header}")
    print(f"{'shape':<11}{'model':>7}{'batch':>12}{'seeds':>6}{'ours s/step':>13}{'TRL s/step':>12}{'ours/TRL':>10}")
    for r in results:
        print(f"{r['shape']:<11}{r['size']:>7}{r['prompts']:>4}x{r['group']}x{r['max_tokens']:<4}{len(r['seeds']):>5}"
              f"{r['ours_s']:>13.3f}{r['trl_s']:>12.3f}{r['ratio']:>10.2f}   per seed: "
              + " ".join(f"{x:.2f}" for x in r["ratio_per_seed"]))
        print(f"{'':<11}ours per step: " + ", ".join(f"{p} {v:.3f}" for p, v in r["ours_parts"].items()))
        if r["trl_generate_s"] is not None:
            print(f"{'':<11}TRL per step: generate {r['trl_generate_s']:.3f}, the rest (update) "
                  f"{r['trl_s'] - r['trl_generate_s']:.3f}")
        if r["shape"] == "realistic":
            ok = "ok" if r["ratio"] <= TARGET_RATIO else "MISSED"
            print(f"{'':<11}step time ours / TRL = {r['ratio']:.2f} (target <= {TARGET_RATIO}) {ok}")
        for label, s in (("ours", r["ours_reward"]), ("TRL ", r["trl_reward"])):
            (f_m, f_s), (l_m, l_s) = s["first_k_mean_std"], s["last_k_mean_std"]
            print(f"{'':<11}reward {label}: first {r['k']} steps {f_m:.3f} ± {f_s:.3f} -> last {r['k']} "
                  f"{l_m:.3f} ± {l_s:.3f}; per step: "
                  + " ".join(f"{m:.2f}±{sd:.2f}" for m, sd in zip(s["step_mean"], s["step_std"])))
        w = r["last_k_welch"]
        if w and w["t"] is not None:
            verdict = "within the seed noise" if w["within_noise"] else "beyond the seed noise"
            print(f"{'':<11}last {r['k']} steps, ours - TRL = {w['diff']:+.3f} ± {w['se']:.3f} (se); Welch t "
                  f"{w['t']:+.2f} on {w['df']:.1f} df vs {w['t_crit']:.2f}: {verdict}")
        elif w is None:
            print(f"{'':<11}one seed: no spread, no Welch comparison")
        lo, hi = r["ours_is_ratio"]
        print(f"{'':<11}our importance weights (engine vs trainer logp): {lo:.4f}..{hi:.4f}")


def model_dir_for(shape: dict, model: str | None) -> str:
    """--model (a directory or a name such as smollm2, resolved to its cached directory), or else
    the shape's embedded model, built if need be."""
    from engine.models.model_names import resolve_model_arg

    return resolve_model_arg(model or shape["size"])


def run_key(shape: str, steps: int, args: argparse.Namespace) -> dict:
    return {"shape": shape, "steps": steps, "model": args.model or SHAPES[shape]["size"], "task": args.task,
            "lr": args.lr}


def finished_runs(path: Path, key: dict) -> dict:
    """{(system, seed): run} of the runs in --out's runs.jsonl with these settings, so that an
    interrupted benchmark goes on where it stopped (a run is written there once it is whole)."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["system"], r["run"]["seed"]): r["run"] for r in rows if r["key"] == key}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="realistic,micro", help="which shapes to run (default: realistic,micro)")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps of the realistic shape, per system")
    p.add_argument("--micro-steps", type=int, default=30, help="GRPO steps of the micro shape, per system")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate of both systems (the recipe's default)")
    p.add_argument("--seeds", default="0,1,2", help="seeds of the realistic shape (micro runs the first only)")
    p.add_argument("--model", default=None, help="a local HF model directory or a name (smollm2, or a tiny size: "
                   "engine.models.model_names) for both systems, instead of each shape's embedded model (the "
                   "shape keeps its batch and length)")
    p.add_argument("--task", default="a-game", help="the recipe's task, for both systems (recipes.tasks.make_task)")
    p.add_argument("--data", default=None, help="the task's data file (--task jsonl)")
    p.add_argument("--out", default=None, help="where to write grpo_step.json and reward_curves.png (default: a "
                   "temporary directory); the runs already there (runs.jsonl) with the same settings are kept")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from engine.model_runner import available_cpus

    threads = available_cpus()
    torch.set_num_threads(threads)
    try:
        import trl
    except ImportError:
        raise SystemExit("trl is not installed here; see `python -m bench.grpo_step --help` for the bench venv")

    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out or tempfile.mkdtemp(prefix="grpo_step_"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in [s for s in args.shapes.split(",") if s]:
        shape = SHAPES[name]
        steps = args.steps if name == "realistic" else args.micro_steps
        model_dir = model_dir_for(shape, args.model)
        ours, theirs = [], []
        key = run_key(name, steps, args)
        done = finished_runs(out / "runs.jsonl", key)
        for i, seed in enumerate(seeds if shape["all_seeds"] else seeds[:1]):
            order = [("ours", run_ours, ours), ("trl", run_trl, theirs)]
            for system, run, runs in order if i % 2 == 0 else order[::-1]:
                if (system, seed) in done:
                    log.info("%s, seed %d: %s kept from %s", name, seed, system, out / "runs.jsonl")
                    runs.append(done[system, seed])
                    continue
                log.info("%s, seed %d: %s, %d steps", name, seed, system, steps)
                t = time.perf_counter()
                runs.append(run(model_dir, shape, steps, args.lr, seed, out / f"{system}-{name}-{seed}",
                                args.task, args.data))
                with (out / "runs.jsonl").open("a") as f:
                    f.write(json.dumps({"key": key, "system": system, "run": runs[-1]}) + "\n")
                log.info("%s, seed %d: %s took %.0f s", name, seed, system, time.perf_counter() - t)
            entry = {**summarize(name, ours, theirs), "ours": ours, "trl": theirs, **shape, **key,
                     "trl_version": trl.__version__}
            (out / "grpo_step.json").write_text(json.dumps(results + [entry], indent=2))
        results.append(entry)

    report(results, f"GRPO, ours vs TRL {trl.__version__}, task {args.task}, torch {torch.__version__}, "
                    f"{threads} threads, lr {args.lr}")
    png = plot(results, f"GRPO on {args.task}", out / "reward_curves.png") if results else None
    print(f"figures: {out / 'grpo_step.json'}" + (f", curves: {png}" if png else ""))


if __name__ == "__main__":
    main()
