"""Seconds per GRPO step: our recipe (sidecar + accelerate) against TRL's `GRPOTrainer` with its
built-in HF generation, on the same model, toy task ("a-game"), group size, batch and learning
rate; plus both reward curves over the same number of steps.

Two shapes:
  realistic: 8 prompts x 8 completions of up to 64 tokens on the small model (~52M params);
             target: our step <= 0.5x TRL's.
  micro:     1 prompt x 8 completions of up to 8 tokens on the mini model (~1M params): shows
             the fixed overhead of each step (TRL takes about 0.05 s here).

A step is everything between two optimizer steps: generation, rewards, the update and, for us,
the weight push to the sidecar. The first step of each run is a warm-up and not timed; the
sidecar's start is not counted (it is started once per training run).

trl is not a dependency of this project; install it only in the benchmark's environment:

    python -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0
    .venv-bench/bin/pip install -e . trl==1.16.0
    .venv-bench/bin/python -m bench.grpo_step            # both shapes (~10 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger("bench.grpo_step")

TARGET_RATIO = 0.5
SHAPES = {
    "realistic": {"size": "small", "prompts": 8, "group": 8, "max_tokens": 64},
    "micro": {"size": "mini", "prompts": 1, "group": 8, "max_tokens": 8},
}


def run_ours(model_dir: str, shape: dict, steps: int, lr: float, seed: int, out_dir: Path) -> dict:
    from recipes.rl_train import train

    train("grpo", [
        "--model", model_dir, "--max-steps", str(steps), "--prompts-per-step", str(shape["prompts"]),
        "--group-size", str(shape["group"]), "--max-tokens", str(shape["max_tokens"]), "--lr", str(lr),
        "--seed", str(seed), "--output-dir", str(out_dir), "--report-to", "none", "--log-level", "WARNING",
    ])
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"step_seconds": [r["timing/step"] for r in rows], "reward": [r["reward"] for r in rows],
            "generate_seconds": [r["timing/generate"] for r in rows],
            "train_seconds": [r["timing/train"] for r in rows],
            "sync_seconds": [r["timing/weight_sync"] for r in rows]}


def run_trl(model_dir: str, shape: dict, steps: int, lr: float, seed: int, out_dir: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from recipes.tasks import AGame

    # AutoTokenizer would swap in Qwen2's own tokenizer class for this model type.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    task = AGame(tokenizer, seed)
    prompts = [it["prompt"] for it in task.prompts(shape["prompts"] * (steps + 1))]

    def a_game_reward(prompts, completions, completion_ids, **kwargs):
        return [task.reward({}, ids, text) for ids, text in zip(completion_ids, completions)]

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
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=a_game_reward, args=cfg, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), callbacks=[timer])
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
    return {"step_seconds": timer.seconds, "reward": rewards, "generate_seconds": gen_seconds}


def summarize(name: str, ours: dict, trl: dict) -> dict:
    timed = slice(1, None)  # step 1 is the warm-up
    o, t = statistics.median(ours["step_seconds"][timed]), statistics.median(trl["step_seconds"][timed])
    k = max(1, min(5, len(ours["reward"]) // 2))

    def ends(r):
        return sum(r[:k]) / k, sum(r[-k:]) / k

    return {"shape": name, "ours_s": o, "trl_s": t, "ratio": o / t, "k": k,
            "ours_reward": ends(ours["reward"]), "trl_reward": ends(trl["reward"]),
            "ours_parts": {p: statistics.median(ours[f"{p}_seconds"][timed]) for p in ("generate", "train", "sync")},
            "trl_generate_s": statistics.median(trl["generate_seconds"][timed]) if trl["generate_seconds"] else None}


def plot(curves: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, r in curves.items():
        ax.plot(range(1, len(r) + 1), r, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO on a-game, small model, 8 prompts x 8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="realistic,micro", help="which shapes to run (default: realistic,micro)")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps of the realistic shape, per system")
    p.add_argument("--micro-steps", type=int, default=30, help="GRPO steps of the micro shape, per system")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate of both systems (the recipe's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="where to write grpo_step.json and the reward-curve PNG "
                   "(default: a temporary directory)")
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

    from engine.tiny_model import build_tiny_model, default_model_dir

    out = Path(args.out or tempfile.mkdtemp(prefix="grpo_step_"))
    out.mkdir(parents=True, exist_ok=True)
    results, curves = [], {}
    for name in [s for s in args.shapes.split(",") if s]:
        shape = SHAPES[name]
        steps = args.steps if name == "realistic" else args.micro_steps
        model_dir = str(build_tiny_model(default_model_dir(shape["size"]), shape["size"]))
        log.info("%s: ours, %d steps", name, steps)
        ours = run_ours(model_dir, shape, steps, args.lr, args.seed, out / f"ours-{name}")
        log.info("%s: TRL %s GRPOTrainer, %d steps", name, trl.__version__, steps)
        theirs = run_trl(model_dir, shape, steps, args.lr, args.seed, out / f"trl-{name}")
        results.append({**summarize(name, ours, theirs), "ours": ours, "trl": theirs, **shape, "steps": steps})
        if name == "realistic":
            curves = {"ours (sidecar)": ours["reward"], f"TRL {trl.__version__}": theirs["reward"]}

    print(f"\nGRPO step time, torch {torch.__version__}, trl {trl.__version__}, {threads} threads, lr {args.lr}")
    print(f"{'shape':<11}{'model':>7}{'batch':>12}{'ours s/step':>13}{'TRL s/step':>12}{'ours/TRL':>10}"
          f"   reward first->last {results[0]['k'] if results else 5} steps (ours | TRL)")
    for r in results:
        print(f"{r['shape']:<11}{r['size']:>7}{r['prompts']:>4}x{r['group']}x{r['max_tokens']:<4}{r['ours_s']:>12.3f}"
              f"{r['trl_s']:>12.3f}{r['ratio']:>10.2f}   {r['ours_reward'][0]:.3f}->{r['ours_reward'][1]:.3f} | "
              f"{r['trl_reward'][0]:.3f}->{r['trl_reward'][1]:.3f}")
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["ours_parts"].items())
        print(f"{'':<11}ours per step: {parts}")
        if r["trl_generate_s"] is not None:
            print(f"{'':<11}TRL per step: generate {r['trl_generate_s']:.3f}, the rest (update) "
                  f"{r['trl_s'] - r['trl_generate_s']:.3f}")
    for r in results:
        if r["shape"] == "realistic":
            ok = "ok" if r["ratio"] <= TARGET_RATIO else "MISSED"
            print(f"realistic: ours / TRL = {r['ratio']:.2f} (target <= {TARGET_RATIO}) {ok}")
    for label, rew in curves.items():
        print(f"reward curve, {label}: " + " ".join(f"{x:.2f}" for x in rew))
    (out / "grpo_step.json").write_text(json.dumps(results, indent=2))
    png = plot(curves, out / "reward_curves.png") if curves else None
    print(f"figures: {out / 'grpo_step.json'}" + (f", curves: {png}" if png else ""))


if __name__ == "__main__":
    main()
