"""The RL training loop shared by `recipes.grpo` and `recipes.ppo`: rollouts from the sidecar,
a policy-gradient step with accelerate, a weight push after every optimizer step."""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import logging
import time
from argparse import SUPPRESS
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from recipes import losses as L
from recipes.algorithms import ALGORITHMS
from recipes.batch import Batch, build_batch, completion_logits, token_logprobs
from recipes.lora import add_lora_args, wrap_lora
from recipes.ranks import my_rows, same_permutation, share
from recipes.seeds import request_seed
from recipes.task_defaults import default_help, fill_task_defaults
from recipes.tasks import TASKS, reward_metrics
from rollout.types import Rollout
from weight_sync.trainer.ranks import follow_push

log = logging.getLogger("recipes")

DELTA = {"auto": None, "on": True, "off": False}  # --delta -> push_weights(delta=...)


def build_parser(algo: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m recipes.{algo}",
        description=(f"{algo.upper()} on the rollout sidecar. With no flags: builds the embedded tiny model, starts "
                     "its own sidecar, trains on the toy 'a-game' task on CPU and shows the reward rising."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="local HF causal-LM directory, or a name: smollm2 (needs the 'real' "
                   "extra, see README 'Real models') or a tiny size (default: the embedded tiny model)")
    p.add_argument("--rollout-url", default=None,
                   help="tcp://HOST:PORT of a running sidecar (default: start one for this run)")
    p.add_argument("--token", default="", help="the sidecar's shared token, if it has one")
    p.add_argument("--max-steps", type=int, default=SUPPRESS, help=f"optimizer steps {default_help('max_steps')}")
    p.add_argument("--output-dir", default=f"out/{algo}", help="checkpoint, metrics.jsonl, reward_curve.png")
    p.add_argument("--report-to", default="none", choices=["none", "wandb"], help="wandb runs offline without login")
    p.add_argument("--task", default="a-game", choices=TASKS,
                   help="toy task, generated arithmetic word problems, or GSM8K from --data (jsonl: same as gsm8k)")
    p.add_argument("--data", default=None, help="JSONL of question/answer (GSM8K format) for --task gsm8k")
    p.add_argument("--task-level", type=int, default=1, help="difficulty of --task arithmetic (1-4)")
    p.add_argument("--answer-format", default="hashes", choices=["hashes", "boxed"],
                   help="how arithmetic/gsm8k prompts ask for the answer: after '####' or in \\boxed{}")
    p.add_argument("--format-reward", type=float, default=SUPPRESS, metavar="W",
                   help="added to the 0/1 correctness when the answer uses --answer-format: rewards in [0, 1 + W] "
                        + default_help("format_reward"))
    p.add_argument("--prompts-per-step", type=int, default=SUPPRESS, help=default_help("prompts_per_step"))
    p.add_argument("--group-size", type=int, default=SUPPRESS, help=f"samples per prompt (n) {default_help('group_size')}")
    p.add_argument("--max-tokens", type=int, default=SUPPRESS, help=f"completion length limit {default_help('max_tokens')}")
    p.add_argument("--temperature", type=float, default=SUPPRESS, help=default_help("temperature"))
    p.add_argument("--lr", type=float, default=SUPPRESS, help=default_help("lr"))
    add_loss_args(p.add_argument_group("the loss"))
    p.add_argument("--async", dest="async_", action="store_true",
                   help="generate step k+1's rollouts while step k trains (staleness 1)")
    p.add_argument("--pause-mode", default=None, choices=["abort", "wait", "keep"], help="pause mode of each push")
    p.add_argument("--delta", default="auto", choices=list(DELTA),
                   help="push only the weights' elements that changed since the last push: auto (when the push "
                        "travels in bf16/fp16 and that is fewer bytes; a full push every 20), on, off")
    p.add_argument("--save-steps", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--check-sync", action="store_true",
                   help="after each push, check the sidecar's weights checksum equals the trainer's")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds everything: prompts, the trainer's torch RNG, the sidecar and each request's sampling "
                        "(the same seed gives the same first-step rollouts)")
    p.add_argument("--log-completions", type=int, default=2, metavar="K",
                   help="write the groups of the first K prompts of each step to completions.jsonl (0: none)")
    p.add_argument("--device", default="cpu", help="trainer device: cpu or cuda (accelerate picks when cuda)")
    p.add_argument("--engine", default="native", choices=["native", "vllm"],
                   help="engine of the sidecar this run starts (passed to rollout.serve --engine; with --rollout-url, "
                        "say which engine that sidecar runs). vllm on CPU: rollouts are not seeded per request")
    p.add_argument("--sidecar-device", default=None,
                   help="device of the sidecar this run starts (default: cpu beside a CPU trainer, else the GPU "
                        "after the trainer's); passed to rollout.serve --device")
    p.add_argument("--sidecar-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype the sidecar this run starts serves in (rollout.serve --dtype; auto: float32 on CPU, "
                        "the checkpoint's on a GPU); pushes travel in it, and deltas pay in bf16/fp16")
    add_ray_args(p.add_argument_group("on a Ray cluster (the 'ray' extra; README: On a Ray cluster)"))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="what the trainer logs (the sidecar it starts logs WARNING and up)")
    add_lora_args(p)
    ALGORITHMS[algo].add_args(p)
    return p


def add_loss_args(p) -> None:
    """The policy loss's knobs, the same for every algorithm."""
    p.add_argument("--clip-low", type=float, default=0.2, help="PPO clip below: the ratio's floor is 1 - this")
    p.add_argument("--clip-high", type=float, default=0.28, help="PPO clip above (DAPO's clip-higher): the ratio's "
                                                                   "ceiling is 1 + this")
    p.add_argument("--beta", type=float, default=0.0,
                   help="weight of the k3 KL to the initial policy (0, the default: no reference model, and the "
                        "logged kl stays 0)")
    p.add_argument("--loss-agg", default="token-mean", choices=list(L.AGGREGATIONS),
                   help="how token losses make the batch's: the mean over all tokens (DAPO), the mean of each "
                        "sequence's mean (GRPO's paper), or each sequence's sum over the longest possible (Dr. GRPO)")
    p.add_argument("--is-cap", type=float, default=2.0, help="truncated importance-sampling cap (0: off)")
    p.add_argument("--epochs", type=int, default=1, help="passes over each batch")
    p.add_argument("--minibatches", type=int, default=1, help="optimizer steps per pass")


def add_ray_args(p) -> None:
    p.add_argument("--ray", action="store_true",
                   help="start the sidecars as Ray actors (rollout.ray_launcher) instead of one local process")
    p.add_argument("--ray-address", default=None,
                   help="cluster to join (auto: the one `ray start` runs here; default: RAY_ADDRESS, else a "
                        "local cluster for this run)")
    p.add_argument("--num-sidecars", type=int, default=1, help="sidecars on the cluster (each one engine)")
    p.add_argument("--placement", default="pack", choices=["pack", "spread"],
                   help="pack: as few nodes as fit; spread: one sidecar per node where possible")


def sidecar_device(trainer_device: torch.device, requested: str | None = None) -> str:
    """Where the sidecar this run starts puts its engine: as asked, else the CPU beside a CPU
    trainer, else the GPU after the trainer's (one NCCL group cannot hold two ranks on one GPU)."""
    if requested:
        return requested
    if trainer_device.type != "cuda":
        return "cpu"
    index = trainer_device.index if trainer_device.index is not None else torch.cuda.current_device()
    return f"cuda:{index + 1}"


def sidecar_command(args, model_dir: str, trainer_device: torch.device, device: str | None = None) -> list[str]:
    """The flags of the sidecar this run starts (after `--model`); `device` overrides where it runs."""
    return ["--max-model-len", "1024", "--log-level", "WARNING", "--stats-interval", "0", "--max-num-seqs", "128",
            "--device", device or sidecar_device(trainer_device, args.sidecar_device), "--seed", str(args.seed),
            "--engine", args.engine, "--dtype", getattr(args, "sidecar_dtype", "auto")]


def seeds_requests(args, trainer_device: torch.device) -> bool:
    """Whether each request carries its own seed: not on vLLM's CPU build, where a seeded request
    fails (it would kill vLLM's engine core); --seed still seeds prompts, the trainer and the sidecar."""
    if args.engine == "vllm" and sidecar_device(trainer_device, args.sidecar_device) == "cpu":
        log.warning("--engine vllm on CPU: rollouts are not seeded per request (vLLM's CPU build cannot seed a "
                    "single request), so the same --seed no longer gives the same rollouts")
        return False
    return True


def _rollout_source(args, model_dir: str, trainer_device: torch.device):
    """A connected RolloutClient, and the sidecar we started (or None)."""
    from rollout import RolloutClient
    from rollout.launcher import LocalSidecar

    sidecar = None
    url = args.rollout_url
    if args.ray:  # imported only here: without --ray, Ray is never imported
        if url is not None:
            raise ValueError("--ray starts the sidecars on the cluster: drop --rollout-url")
        from rollout.ray_launcher import RaySidecars

        gpu = trainer_device.type == "cuda" or (args.sidecar_device or "cpu").startswith("cuda")
        # "cuda" alone: an actor sees only its own GPU
        flags = sidecar_command(args, model_dir, trainer_device, "cuda" if gpu else "cpu")
        sidecar = RaySidecars(model_dir, args.num_sidecars, flags, placement=args.placement,
                              gpus_per_sidecar=1 if gpu else 0, ray_address=args.ray_address)
        return sidecar.client(), sidecar, None
    if url is None:
        sidecar = LocalSidecar(model_dir, *sidecar_command(args, model_dir, trainer_device), token=args.token)
        url = sidecar.url
    return RolloutClient(url, token=args.token), sidecar, url


@dataclass
class Run:
    """Everything one training run holds, built once by `setup`."""

    args: argparse.Namespace
    algo: object  # recipes.algorithms.GRPO | PPO
    accelerator: object
    module: torch.nn.Module  # what trains (the policy, or policy + value head), prepared by accelerate
    optimizer: torch.optim.Optimizer
    ref: torch.nn.Module | None  # the frozen initial policy, for the KL term
    tokenizer: object
    task: object
    tracker: object
    client: object | None  # rollout.RolloutClient; None on ranks other than 0 (recipes/ranks.py)
    sidecar: object | None  # the sidecar this run started, if any
    gen_client: object | None = None  # --async: a second client that generates while the first pushes
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    params: object = None  # engine.SamplingParams of every generate (seeded per request in _generate)
    seed_requests: bool = True  # False on vLLM's CPU build (seeds_requests)
    generate_calls: int = 0
    version: int = 0
    pending: concurrent.futures.Future | None = None  # --async: the next step's rollouts
    pushed: dict | None = None  # the last push's reply (rank 0): its bytes go in the step's metrics

    def policy(self) -> torch.nn.Module:
        return self.algo.policy_of(self.accelerator.unwrap_model(self.module))


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


def setup(algo, args: argparse.Namespace) -> Run:
    """Model, optimizer (accelerate), task, tracker and a connected rollout client."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_names import resolve_model_arg
    from engine.sampling_params import SamplingParams
    from recipes.tasks import make_task
    from recipes.tracking import Tracker
    from rollout import RolloutClient
    from weight_sync import flatten_parameters

    torch.manual_seed(args.seed)
    accelerator = Accelerator(cpu=args.device == "cpu")
    model_dir = resolve_model_arg(args.model or "tiny")  # a name (smollm2, tiny, ...): its cached directory
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
    task = make_task(args.task, tokenizer, args.data, args.seed, level=args.task_level,
                     format_reward=args.format_reward, answer_format=args.answer_format)
    main = accelerator.is_main_process
    tracker = Tracker(out_dir, args.report_to, f"{algo.name}-{args.task}", vars(args), enabled=main)
    client, sidecar, url = _rollout_source(args, model_dir, accelerator.device) if main else (None, None, None)
    run = Run(args, algo, accelerator, module, optimizer, ref, tokenizer, task, tracker, client, sidecar,
              params=SamplingParams(n=args.group_size, temperature=args.temperature, max_tokens=args.max_tokens),
              seed_requests=seeds_requests(args, accelerator.device) if main else True)
    if args.async_ and main:
        run.gen_client = sidecar.client() if args.ray else RolloutClient(url, token=args.token)
        run.pool = concurrent.futures.ThreadPoolExecutor(1)
    if main:  # the group's backend follows the trainer's device: gloo on CPU, NCCL on CUDA
        client.init_weight_sync(device=accelerator.device)
    return run


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
    if run.sidecar is not None:
        run.sidecar.stop()


def _save(policy, tokenizer, path: Path) -> None:
    policy.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def update(run: Run, rollouts: list, rewards: torch.Tensor) -> dict:
    """One batch of rollouts -> `epochs` x `minibatches` optimizer steps. Returns metrics."""
    args, device = run.args, run.accelerator.device
    batch = build_batch(rollouts, run.tokenizer.pad_token_id or 0).to(device)
    old = _before_update(run, batch, rewards.to(device))
    stats = {"clip_ratio": [], "kl": [], "loss": [], "value_loss": []}
    if len(rollouts) // args.minibatches < run.accelerator.num_processes:
        raise ValueError(f"{len(rollouts)} rollouts in {args.minibatches} minibatches leave a rank of "
                         f"{run.accelerator.num_processes} without rows")
    own = torch.zeros(len(rollouts), dtype=torch.bool, device=device)  # the rows this rank trains on
    for epoch in range(args.epochs):
        perm = same_permutation(len(rollouts), args.seed * 1_000_003 + run.version * 101 + epoch, device)
        for idx in perm.chunk(args.minibatches):
            idx = my_rows(idx, run.accelerator)
            own[idx] = True
            _minibatch_step(run, batch, old, idx, stats)
    mask = batch.mask * own.unsqueeze(1)
    diff = (old.logp - batch.engine_logp).abs() * mask
    is_ratio = torch.exp(old.logp - batch.engine_logp)
    n_tok = mask.sum().clamp(min=1)
    mean = {k: sum(v) / len(v) for k, v in stats.items() if v}
    return {
        **mean,
        "entropy": old.entropy,
        "sampling/sampling_logp_difference/mean": (diff.sum() / n_tok).item(),
        "sampling/sampling_logp_difference/max": diff.max().item(),
        "sampling/importance_sampling_ratio/min": is_ratio[mask.bool()].min().item(),
        "sampling/importance_sampling_ratio/mean": L.masked_mean(is_ratio, mask).item(),
        "sampling/importance_sampling_ratio/max": is_ratio[mask.bool()].max().item(),
        # share of tokens whose weight the cap truncated (0 with --is-cap 0: no weights)
        "sampling/importance_sampling_ratio/capped": (
            L.masked_mean((is_ratio > args.is_cap).float(), mask).item() if args.is_cap > 0 else 0.0),
    }


def _before_update(run: Run, batch: Batch, rewards: torch.Tensor) -> SimpleNamespace:
    """What the update needs from the policy as it was: logprobs, values, entropy (unless the
    algorithm takes them from the training forward), the reference's logprobs, advantages."""
    args = run.args
    old = SimpleNamespace(logp=None, values=None, entropy=None, ref_logp=None, adv=None, returns=None)
    with torch.no_grad():
        if run.algo.single_pass:  # filled, row by row, by the training forward
            old.logp = torch.zeros_like(batch.engine_logp)
        else:
            logits, old.values = completion_logits(run.module, batch, args.temperature)
            old.logp = token_logprobs(logits, batch.targets)
            old.entropy = L.masked_mean(L.entropy_from_logits(logits), batch.mask).item()
            del logits
        if run.ref is not None:
            old.ref_logp = token_logprobs(completion_logits(run.ref, batch, args.temperature)[0], batch.targets)
        old.adv, old.returns = run.algo.advantages(rewards, batch.mask, old.values)
    return old


def _minibatch_step(run: Run, batch: Batch, old: SimpleNamespace, idx: torch.Tensor, stats: dict) -> None:
    args = run.args
    mb = batch.select(idx)
    m = mb.mask
    logits, values = completion_logits(run.module, mb, args.temperature)
    logp = token_logprobs(logits, mb.targets)
    if run.algo.single_pass:  # one minibatch step per row: its pre-update logprobs are these
        old.logp[idx] = logp.detach()
        with torch.no_grad():
            old.entropy = L.masked_mean(L.entropy_from_logits(logits), m).item()
    del logits
    # The clip is around the trainer's policy before this update (the proximal policy); truncated
    # importance weights correct for the engine having sampled from another policy: its own
    # numerics in sync mode, the previous step's weights with --async (AReaL's decoupled PPO).
    # With --is-cap 0 and --async, the ratio is taken against the sampling policy instead.
    behaviour = batch.engine_logp if args.async_ and args.is_cap <= 0 else old.logp
    is_w = None
    if args.is_cap > 0:
        is_w = L.truncated_is_weights(old.logp[idx], batch.engine_logp[idx], args.is_cap)
    pg, clipped = L.clipped_policy_loss(logp, behaviour[idx], old.adv[idx], m, args.clip_low, args.clip_high, is_w)
    loss = L.aggregate(pg, m, args.loss_agg, args.max_tokens)
    kl = torch.zeros((), device=logp.device)
    if old.ref_logp is not None:
        kl = L.masked_mean(L.k3_kl(logp, old.ref_logp[idx]), m)
        loss = loss + args.beta * kl
    extra = run.algo.extra_loss(values, None if old.values is None else old.values[idx],
                                None if old.returns is None else old.returns[idx], m)
    if extra is not None:
        loss = loss + args.vf_coef * extra
        stats["value_loss"].append(extra.item())
    run.optimizer.zero_grad(set_to_none=True)
    run.accelerator.backward(loss)
    run.accelerator.clip_grad_norm_(run.module.parameters(), 1.0)
    run.optimizer.step()
    stats["clip_ratio"].append(L.masked_mean(clipped, m).item())
    stats["kl"].append(kl.item())
    stats["loss"].append(loss.item())
