"""The RL training loop shared by `recipes.grpo` and `recipes.ppo`: rollouts from the sidecar,
a policy-gradient step with accelerate, a weight push after every optimizer step.

Beside it: the flags (recipes/flags.py), where rollouts come from (rollout_source.py), what a run
holds (run.py) and the update itself (policy_update.py)."""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from recipes.algorithms import ALGORITHMS
from recipes.flags import DELTA, build_parser
from recipes.lora import wrap_lora
from recipes.policy_update import update
from recipes.ranks import share
from recipes.rollout_source import rollout_source, seeds_requests
from recipes.rollout_source import sidecar_command, sidecar_device  # noqa: F401 - importable from here, as before
from recipes.run import Run
from recipes.seeds import request_seed
from recipes.task_defaults import fill_task_defaults
from recipes.tasks import reward_metrics
from rollout.common.types import Rollout
from weight_sync.trainer.ranks import follow_push

log = logging.getLogger("recipes")

def train(algo: str, argv: list[str] | None = None) -> dict:
    args = fill_task_defaults(build_parser(algo).parse_args(argv))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = setup(ALGORITHMS[algo](args), args)
    try:
        push(run)  # the sidecar serves exactly the trainer's weights from the start
        bar = tqdm(range(args.max_steps), desc=algo, unit="step", disable=not run.accelerator.is_main_process)
        with logging_redirect_tqdm():  # log lines print above the bar instead of breaking it
            for step in bar:
                metrics = train_step(run, step)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}")
        return finish(run)
    finally:
        close(run)


def setup(algo, args, make_task=None) -> Run:
    """Model, optimizer (accelerate), task, tracker and a connected rollout client. `make_task(args,
    tokenizer)`: the run's task (default: --task's; recipes.agent's is an environment factory)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.sampling_params import SamplingParams
    from recipes.tracking import Tracker
    from recipes import routing_replay
    from rollout import RolloutClient
    from rollout.sidecar.serve_args import model_dir_or_exit
    from weight_sync import flatten_parameters

    # a name (smollm2, tiny, ...): its cached directory; no model there: one line, as rollout.serve says it
    model_dir = model_dir_or_exit(args.model)
    exact = None
    if getattr(args, "on_policy", "plain") == "exact":  # refused before anything starts
        from recipes.exact_policy import ExactPolicy, refusal

        if (why := refusal(args)) is not None:
            raise ValueError(f"--on-policy exact: {why}")
        exact = ExactPolicy(model_dir, args)
    torch.manual_seed(args.seed)
    accelerator = Accelerator(cpu=args.device == "cpu")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if args.device == "cpu":  # pushes then send straight from the weights' memory (weight_sync/README.md)
        flatten_parameters(policy)
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if args.beta > 0 else None
    module = algo.wrap(wrap_lora(policy, args))
    trainable = [p for p in module.parameters() if p.requires_grad]  # with --lora-r: the adapter (and a value head)
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    module, optimizer = accelerator.prepare(module, optimizer)
    if ref is not None:
        ref = ref.to(accelerator.device)
    task = _task_of(args, tokenizer) if make_task is None else make_task(args, tokenizer)
    main = accelerator.is_main_process
    tracker = Tracker(out_dir, args.report_to, f"{algo.name}-{args.task}", vars(args), enabled=main)
    client, sidecar, url = rollout_source(args, model_dir, accelerator.device) if main else (None, None, None)
    run = Run(args, algo, accelerator, module, optimizer, ref, tokenizer, task, tracker, client, sidecar,
              params=SamplingParams(n=args.group_size, temperature=args.temperature, max_tokens=args.max_tokens,
                                    return_routed_experts=bool(routing_replay.routers(policy))),
              seed_requests=seeds_requests(args, accelerator.device) if main else True, exact=exact)
    if args.async_ and main:
        run.gen_client = sidecar.client() if args.ray else RolloutClient(url, token=args.token)
        run.pool = concurrent.futures.ThreadPoolExecutor(1)
    if main:  # the group's backend follows the trainer's device: gloo on CPU, NCCL on CUDA
        client.init_weight_sync(device=accelerator.device)
    return run


def _task_of(args, tokenizer):
    from recipes.tasks import make_task

    return make_task(args.task, tokenizer, args.data, args.seed, level=args.task_level,
                     format_reward=args.format_reward, answer_format=args.answer_format)


def push(run: Run) -> float:
    """Push the trainer's policy as `run.version`; with --check-sync, check what the engines hold.
    Ranks other than 0 follow rank 0's push (and checksum): they take part in its gathers."""
    t = time.perf_counter()
    if run.client is None:
        follow_push(run.policy())
        if run.args.check_sync:
            follow_push(run.policy())
        return time.perf_counter() - t
    run.pushed = run.client.push_weights(run.policy(), version=run.version, pause_mode=run.args.pause_mode,
                                         mode=run.args.lora_push, delta=DELTA[run.args.delta])
    if run.args.check_sync:
        want = run.client.checksum_of(run.policy())
        got = run.client.weights_checksums()
        if any(c != want for c in got):
            raise RuntimeError(f"weights checksum mismatch after push {run.version}: {got} != {want}")
    return time.perf_counter() - t


def push_metrics(pushed: dict | None) -> dict:
    """The bytes a push put on the wire beside the full weights' (a delta push: weight_sync/common/delta_push.py)."""
    trainer = (pushed or {}).get("trainer")
    if not isinstance(trainer, dict):
        return {}
    out = {"weight_sync/bytes": trainer["bytes"], "weight_sync/full_bytes": trainer.get("full_bytes", trainer["bytes"]),
           "weight_sync/delta": int(bool(trainer.get("delta")))}
    if "encode_seconds" in trainer:  # a delta: the trainer's encode, the slowest engine's apply
        out["weight_sync/encode_seconds"] = trainer["encode_seconds"]
        applied = [s["apply_seconds"] for s in pushed.get("sidecars", []) if isinstance(s, dict) and "apply_seconds" in s]
        if applied:
            out["weight_sync/apply_seconds"] = max(applied)
    return out


def _generate(run: Run, client) -> tuple[list, list, float]:
    """One step's prompts and their groups, each prompt with its own seed (recipes/seeds.py), so
    the same --seed gives the same rollouts however the sidecar batches them."""
    items = run.task.prompts(run.args.prompts_per_step)
    call, run.generate_calls = run.generate_calls, run.generate_calls + 1
    params = [replace(run.params, seed=request_seed(run.args.seed, call, i) if run.seed_requests else None)
              for i in range(len(items))]
    t = time.perf_counter()
    groups = client.generate([it["prompt"] for it in items], params)
    return items, groups, time.perf_counter() - t


def _next_rollouts(run: Run, step: int) -> tuple[list, list, float]:
    """This step's rollouts: generated now, or (--async) while the previous step trained."""
    if not run.args.async_:
        return _generate(run, run.client)
    if run.pending is None:
        run.pending = run.pool.submit(_generate, run, run.gen_client)
    items, groups, t_gen = run.pending.result()
    more = step + 1 < run.args.max_steps
    run.pending = run.pool.submit(_generate, run, run.gen_client) if more else None
    return items, groups, t_gen


def train_step(run: Run, step: int) -> dict:
    """Rollouts -> rewards -> update -> push; logs and returns the step's metrics."""
    t_step = time.perf_counter()
    mine = _next_rollouts(run, step) if run.client is not None else None
    items, groups, t_gen = share(run.accelerator, mine, tuple[list[dict], list[list[Rollout]], float])
    rollouts = [r for g in groups for r in g]
    rewards = torch.tensor([run.task.reward(it, r.token_ids, r.text) for it, g in zip(items, groups) for r in g])
    t_train = time.perf_counter()
    metrics = update(run, rollouts, rewards)
    t_train = time.perf_counter() - t_train
    run.version += 1
    t_sync = push(run)
    lengths = [len(r.token_ids) for r in rollouts]
    metrics.update({
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "completions/mean_length": sum(lengths) / len(lengths),
        "timing/generate": t_gen,
        "timing/train": t_train,
        "timing/weight_sync": t_sync,
        "timing/step": time.perf_counter() - t_step,
        "staleness": run.version - 1 - min(r.weight_versions[0] for r in rollouts if r.weight_versions),
        "weight_version": run.version,
        **push_metrics(run.pushed),
    })
    metrics.update(reward_metrics(run.task, items, groups))  # reward/correct, reward/format: {} for a-game
    run.tracker.log(step + 1, metrics)
    run.tracker.log_completions(step + 1, _completion_rows(run, items, groups, rewards))
    if run.args.save_steps and (step + 1) % run.args.save_steps == 0 and run.accelerator.is_main_process:
        _save(run.policy(), run.tokenizer, Path(run.args.output_dir) / f"checkpoint-{step + 1}")
    return metrics


def _completion_rows(run: Run, items: list, groups: list, rewards: torch.Tensor) -> list[dict]:
    """The first --log-completions prompts' groups, for completions.jsonl."""
    rows, flat = [], iter(rewards.tolist())
    for item, group in zip(items, groups):
        scores = [next(flat) for _ in group]
        if len(rows) < run.args.log_completions * len(group):
            rows += [{"prompt": item["prompt"], "answer": item.get("answer"), "text": r.text,
                      "token_ids": r.token_ids, "reward": s} for r, s in zip(group, scores)]
    return rows


def finish(run: Run) -> dict:
    """The final checkpoint, and the reward of the first and last steps."""
    out_dir = Path(run.args.output_dir)
    run.accelerator.wait_for_everyone()
    if run.accelerator.is_main_process:
        _save(run.policy(), run.tokenizer, out_dir / "checkpoint-final")
        log.info("final checkpoint: %s", (out_dir / "checkpoint-final").resolve())
    rows = run.tracker.rows
    k = max(1, min(10, len(rows) // 2))
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    log.info("reward: first %d steps %.3f -> last %d steps %.3f", k, first, k, last)
    return {"first_reward": first, "last_reward": last, "steps": len(rows), "output_dir": str(out_dir)}


def close(run: Run) -> None:
    png = run.tracker.finish()
    if png:
        log.info("reward curve: %s", png)
    if run.pool is not None:
        run.pool.shutdown(wait=True, cancel_futures=True)
    if run.gen_client is not None:
        run.gen_client.close()
    if run.client is not None:
        run.client.close()
    if run.router is not None:
        run.router.stop()
    if run.sidecar is not None:
        run.sidecar.stop()


def _save(policy, tokenizer, path: Path) -> None:
    policy.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
