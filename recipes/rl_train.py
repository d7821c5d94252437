"""The RL training loop shared by `recipes.grpo` and `recipes.ppo`: rollouts from the sidecar,
a policy-gradient step with accelerate, a weight push after every optimizer step."""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

from recipes import losses as L
from recipes.batch import Batch, build_batch, completion_logits, token_logprobs

log = logging.getLogger("recipes")


def build_parser(algo: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m recipes.{algo}",
        description=(f"{algo.upper()} on the rollout sidecar. With no flags: builds the embedded tiny model, starts "
                     "its own sidecar, trains on the toy 'a-game' task on CPU and shows the reward rising."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="local HF causal-LM directory (default: the embedded tiny model)")
    p.add_argument("--rollout-url", default=None,
                   help="tcp://HOST:PORT of a running sidecar (default: start one for this run)")
    p.add_argument("--token", default="", help="the sidecar's shared token, if it has one")
    p.add_argument("--max-steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--output-dir", default=f"out/{algo}", help="checkpoint, metrics.jsonl, reward_curve.png")
    p.add_argument("--report-to", default="none", choices=["none", "wandb"], help="wandb runs offline without login")
    p.add_argument("--task", default="a-game", choices=["a-game", "jsonl"], help="toy task, or prompts from --data")
    p.add_argument("--data", default=None, help="JSONL of prompt/answer (GSM8K format) for --task jsonl")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (n)")
    p.add_argument("--max-tokens", type=int, default=16, help="completion length limit")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28, help="DAPO's clip-higher")
    p.add_argument("--beta", type=float, default=0.0, help="k3 KL to the initial policy (0: no reference model)")
    p.add_argument("--loss-agg", default="token-mean", choices=list(L.AGGREGATIONS))
    p.add_argument("--is-cap", type=float, default=2.0, help="truncated importance-sampling cap (0: off)")
    p.add_argument("--epochs", type=int, default=1, help="passes over each batch")
    p.add_argument("--minibatches", type=int, default=1, help="optimizer steps per pass")
    p.add_argument("--async", dest="async_", action="store_true",
                   help="generate step k+1's rollouts while step k trains (staleness 1)")
    p.add_argument("--pause-mode", default=None, choices=["abort", "wait", "keep"], help="pause mode of each push")
    p.add_argument("--save-steps", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--check-sync", action="store_true",
                   help="after each push, check the sidecar's weights checksum equals the trainer's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="trainer device: cpu or cuda (accelerate picks when cuda)")
    p.add_argument("--log-level", default="INFO")
    if algo == "grpo":
        p.add_argument("--no-std-scale", action="store_true", help="Dr. GRPO: do not divide advantages by the std")
    else:
        p.add_argument("--gamma", type=float, default=1.0)
        p.add_argument("--lam", type=float, default=0.95)
        p.add_argument("--vf-coef", type=float, default=0.5)
        p.add_argument("--value-clip", type=float, default=0.2)
    return p


class PolicyWithValue(torch.nn.Module):
    """PPO's actor-critic: the HF policy plus a scalar value head on its last hidden state. Its
    forward runs both, so accelerate / DDP wrap one module and see every parameter used."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.value_head = torch.nn.Linear(policy.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, **kwargs):
        out = self.policy(**kwargs, output_hidden_states=True)
        return SimpleNamespace(logits=out.logits, value_estimates=self.value_head(out.hidden_states[-1]).squeeze(-1))


def _rollout_source(args, model_dir: str):
    """A connected RolloutClient, and the sidecar we started (or None)."""
    from rollout import RolloutClient
    from rollout.launcher import LocalSidecar

    sidecar = None
    url = args.rollout_url
    if url is None:
        sidecar = LocalSidecar(model_dir, "--max-model-len", "1024", "--log-level", "WARNING", "--stats-interval", "0",
                               "--max-num-seqs", "128", token=args.token)
        url = sidecar.url
    return RolloutClient(url, token=args.token), sidecar, url


def train(algo: str, argv: list[str] | None = None) -> dict:
    args = build_parser(algo).parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import SamplingParams
    from recipes.tasks import make_task
    from recipes.tracking import Tracker
    from engine.tiny_model import build_tiny_model, default_model_dir
    from rollout import RolloutClient
    from weight_sync import flatten_parameters

    torch.manual_seed(args.seed)
    accelerator = Accelerator(cpu=args.device == "cpu")
    model_dir = args.model or str(build_tiny_model(default_model_dir("tiny"), "tiny"))
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if args.device == "cpu":  # pushes then send straight from the weights' memory (weight_sync/README.md)
        flatten_parameters(policy)
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if args.beta > 0 else None
    module = PolicyWithValue(policy) if algo == "ppo" else policy
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
    module, optimizer = accelerator.prepare(module, optimizer)
    if ref is not None:
        ref = ref.to(accelerator.device)
    task = make_task(args.task, tokenizer, args.data, args.seed)
    tracker = Tracker(out_dir, args.report_to, f"{algo}-{args.task}", vars(args))

    client, sidecar, url = _rollout_source(args, model_dir)
    gen_client = RolloutClient(url, token=args.token) if args.async_ else None
    pool = concurrent.futures.ThreadPoolExecutor(1) if args.async_ else None
    summary: dict = {}
    try:
        client.init_weight_sync()
        version = 0

        def unwrapped_policy():
            m = accelerator.unwrap_model(module)
            return m.policy if algo == "ppo" else m

        def push(v: int) -> float:
            t = time.perf_counter()
            client.push_weights(unwrapped_policy(), version=v, pause_mode=args.pause_mode)
            if args.check_sync:
                want = client._client.sender.checksum(unwrapped_policy())
                got = client.weights_checksums()
                if any(c != want for c in got):
                    raise RuntimeError(f"weights checksum mismatch after push {v}: {got} != {want}")
            return time.perf_counter() - t

        push(version)  # the sidecar serves exactly the trainer's weights from the start
        params = SamplingParams(n=args.group_size, temperature=args.temperature, max_tokens=args.max_tokens)

        def generate(c):
            items = task.prompts(args.prompts_per_step)
            t = time.perf_counter()
            groups = c.generate([it["prompt"] for it in items], params)
            return items, groups, time.perf_counter() - t

        pending = pool.submit(generate, gen_client) if args.async_ else None
        bar = tqdm(range(args.max_steps), desc=algo, unit="step", disable=not accelerator.is_main_process)
        for step in bar:
            t_step = time.perf_counter()
            if args.async_:
                items, groups, t_gen = pending.result()
                pending = pool.submit(generate, gen_client) if step + 1 < args.max_steps else None
            else:
                items, groups, t_gen = generate(client)
            rollouts = [r for g in groups for r in g]
            rewards = torch.tensor([task.reward(it, r.token_ids, r.text) for it, g in zip(items, groups) for r in g])
            t_train = time.perf_counter()
            metrics = _update(algo, args, accelerator, module, optimizer, ref, rollouts, rewards, tokenizer)
            t_train = time.perf_counter() - t_train
            version += 1
            t_sync = push(version)
            lengths = [len(r.token_ids) for r in rollouts]
            metrics.update({
                "reward": rewards.mean().item(),
                "reward_std": rewards.std().item(),
                "completions/mean_length": sum(lengths) / len(lengths),
                "timing/generate": t_gen,
                "timing/train": t_train,
                "timing/weight_sync": t_sync,
                "timing/step": time.perf_counter() - t_step,
                "staleness": version - 1 - min(r.weight_versions[0] for r in rollouts if r.weight_versions),
                "weight_version": version,
            })
            tracker.log(step + 1, metrics)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}")
            if args.save_steps and (step + 1) % args.save_steps == 0:
                _save(unwrapped_policy(), tokenizer, out_dir / f"checkpoint-{step + 1}")
        _save(unwrapped_policy(), tokenizer, out_dir / "checkpoint-final")
        rows = tracker.rows
        k = max(1, min(10, len(rows) // 2))
        first = sum(r["reward"] for r in rows[:k]) / k
        last = sum(r["reward"] for r in rows[-k:]) / k
        summary = {"first_reward": first, "last_reward": last, "steps": len(rows), "output_dir": str(out_dir)}
        log.info("reward: first %d steps %.3f -> last %d steps %.3f", k, first, k, last)
    finally:
        png = tracker.finish()
        if png:
            log.info("reward curve: %s", png)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if gen_client is not None:
            gen_client.close()
        client.close()
        if sidecar is not None:
            sidecar.stop()
    return summary


def _save(policy, tokenizer, path: Path) -> None:
    policy.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def _update(algo, args, accelerator, module, optimizer, ref, rollouts, rewards, tokenizer) -> dict:
    """One batch of rollouts -> `epochs` x `minibatches` optimizer steps. Returns metrics."""
    device = accelerator.device
    batch = build_batch(rollouts, tokenizer.pad_token_id or 0).to(device)
    mask = batch.mask
    ppo = algo == "ppo"
    # GRPO with a single optimizer step per batch is on-policy: the pre-update logprobs are those
    # of the training forward, detached (as TRL does with num_iterations=1), which saves a whole
    # forward over the batch. PPO needs its values before the update, for GAE.
    single_pass = not ppo and args.epochs == 1 and args.minibatches == 1
    old_logp = entropy = None
    with torch.no_grad():
        if not single_pass:
            logits, old_values = completion_logits(module, batch, args.temperature)
            old_logp = token_logprobs(logits, batch.targets)
            entropy = L.masked_mean(L.entropy_from_logits(logits), mask).item()
            del logits
        ref_logp = token_logprobs(completion_logits(ref, batch, args.temperature)[0], batch.targets) if ref else None
        if ppo:
            old_values = old_values * mask
            token_rewards = torch.zeros_like(mask)
            last = (mask.sum(1).long() - 1).clamp(min=0)
            token_rewards[torch.arange(len(rollouts)), last] = rewards.to(device)
            adv, returns = L.gae(token_rewards, old_values, mask, args.gamma, args.lam)
            adv = L.whiten(adv, mask)
        else:
            adv = L.grpo_advantages(rewards.to(device), args.group_size, not args.no_std_scale)

    B = len(rollouts)
    clip_fracs, kls, losses, vlosses = [], [], [], []
    for _ in range(args.epochs):
        perm = torch.randperm(B, device=device)
        for idx in perm.chunk(args.minibatches):
            mb = batch.select(idx)
            m = mb.mask
            logits, values = completion_logits(module, mb, args.temperature)
            logp = token_logprobs(logits, mb.targets)
            if old_logp is None:  # single pass: idx is a permutation of the whole batch
                old_logp = torch.empty_like(logp).index_copy_(0, idx, logp.detach())
                with torch.no_grad():
                    entropy = L.masked_mean(L.entropy_from_logits(logits), m).item()
            del logits
            behaviour = batch.engine_logp if args.async_ else old_logp  # async: sampled from an older policy
            is_w = None
            if args.is_cap > 0 and not args.async_:
                is_w = L.truncated_is_weights(old_logp[idx], batch.engine_logp[idx], args.is_cap)
            pg, clipped = L.clipped_policy_loss(logp, behaviour[idx], adv[idx], m, args.clip_low, args.clip_high, is_w)
            loss = L.aggregate(pg, m, args.loss_agg, args.max_tokens)
            kl = torch.zeros((), device=device)
            if ref_logp is not None:
                kl = L.masked_mean(L.k3_kl(logp, ref_logp[idx]), m)
                loss = loss + args.beta * kl
            if ppo:
                vloss = L.masked_mean(L.clipped_value_loss(values, old_values[idx], returns[idx], m, args.value_clip), m)
                loss = loss + args.vf_coef * vloss
                vlosses.append(vloss.item())
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            clip_fracs.append(L.masked_mean(clipped, m).item())
            kls.append(kl.item())
            losses.append(loss.item())
    diff = (old_logp - batch.engine_logp).abs() * mask
    is_ratio = torch.exp(old_logp - batch.engine_logp)
    n_tok = mask.sum().clamp(min=1)
    extra = {"value_loss": sum(vlosses) / len(vlosses)} if vlosses else {}
    return {
        **extra,
        "loss": sum(losses) / len(losses),
        "kl": sum(kls) / len(kls),
        "entropy": entropy,
        "clip_ratio": sum(clip_fracs) / len(clip_fracs),
        "sampling/sampling_logp_difference/mean": (diff.sum() / n_tok).item(),
        "sampling/sampling_logp_difference/max": diff.max().item(),
        "sampling/importance_sampling_ratio/min": is_ratio[mask.bool()].min().item(),
        "sampling/importance_sampling_ratio/mean": L.masked_mean(is_ratio, mask).item(),
        "sampling/importance_sampling_ratio/max": is_ratio[mask.bool()].max().item(),
    }
