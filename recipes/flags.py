"""The recipes' command line: every flag of `python -m recipes.grpo` and `python -m recipes.ppo`
(the algorithm adds its own, recipes/algorithms.py; LoRA's are recipes/lora.py's)."""

from __future__ import annotations

import argparse
from argparse import SUPPRESS

from recipes import corrections as C
from recipes import losses as L
from recipes.algorithms import ALGORITHMS
from recipes.lora import add_lora_args
from recipes.task_defaults import default_help
from recipes.tasks import TASKS

DELTA = {"auto": None, "on": True, "off": False}  # --delta -> push_weights(delta=...)


def build_parser(algo: str, prog: str | None = None, description: str | None = None,
                 tasks: bool = True) -> argparse.ArgumentParser:
    """`tasks=False`: without the --task flags (recipes.agent's environments take their place)."""
    p = _Parser(
        prog=prog or f"python -m recipes.{algo}",
        description=description or (
            f"{algo.upper()} on the rollout sidecar. With no flags: builds the embedded tiny model, starts "
            "its own sidecar, trains on the toy 'a-game' task on CPU and shows the reward rising."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_run_flags(p, prog.split(".")[-1] if prog else algo)
    if tasks:
        _add_task_flags(p)
    _add_batch_flags(p)
    add_loss_args(p.add_argument_group("the loss"))
    _add_step_flags(p)
    _add_device_flags(p)
    add_ray_args(p.add_argument_group("on a Ray cluster (the 'ray' extra; README: On a Ray cluster)"))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="what the trainer logs (the sidecar it starts logs WARNING and up)")
    add_lora_args(p)
    ALGORITHMS[algo].add_args(p)
    return p


class _Parser(argparse.ArgumentParser):
    """Refuses, at parse time, what one flag alone cannot (a correction's band upside down)."""

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if parsed.is_mode != "none" and (parsed.is_cap is None or parsed.is_cap > 0):
            try:
                C.band(parsed.is_mode, parsed.is_cap, parsed.is_floor)
            except ValueError as e:
                self.error(f"--is-mode {parsed.is_mode} --is-cap {parsed.is_cap} --is-floor {parsed.is_floor}: {e}")
        return parsed


def _add_run_flags(p, algo: str) -> None:
    """The model, where rollouts come from, how long and where the run writes."""
    p.add_argument("--model", default=None, help="local HF causal-LM directory, or a name: smollm2 (needs the 'real' "
                   "extra, see docs/guides/real-models.md) or a tiny size (default: the embedded tiny model)")
    p.add_argument("--rollout-url", default=None,
                   help="tcp://HOST:PORT of a running sidecar, or several, comma-separated (default: start one for "
                   "this run)")
    p.add_argument("--sidecars", type=int, default=1, metavar="N",
                   help="start N local sidecars (one engine each): each call's prompts spread over them, an agent's "
                   "episodes each kept on one (rollout/client/placement.py)")
    p.add_argument("--token", default="", help="the sidecar's shared token, if it has one")
    p.add_argument("--max-steps", type=int, default=SUPPRESS, help=f"optimizer steps {default_help('max_steps')}")
    p.add_argument("--output-dir", default=f"out/{algo}", help="checkpoint, metrics.jsonl, reward_curve.png")
    p.add_argument("--report-to", default="none", choices=["none", "wandb"], help="wandb runs offline without login")


def _add_task_flags(p) -> None:
    """What the policy learns, and how it is rewarded."""
    p.add_argument("--task", default="a-game", choices=TASKS,
                   help="toy task, generated arithmetic word problems, or GSM8K from --data (jsonl: same as gsm8k)")
    p.add_argument("--data", default=None, help="JSONL of question/answer (GSM8K format) for --task gsm8k")
    p.add_argument("--task-level", type=int, default=1, help="difficulty of --task arithmetic (1-4)")
    p.add_argument("--answer-format", default="hashes", choices=["hashes", "boxed"],
                   help="how arithmetic/gsm8k prompts ask for the answer: after '####' or in \\boxed{}")
    p.add_argument("--format-reward", type=float, default=SUPPRESS, metavar="W",
                   help="added to the 0/1 correctness when the answer uses --answer-format: rewards in [0, 1 + W] "
                        + default_help("format_reward"))


def _add_batch_flags(p) -> None:
    """Each step's rollouts and the optimizer's step size."""
    p.add_argument("--prompts-per-step", type=int, default=SUPPRESS, help=default_help("prompts_per_step"))
    p.add_argument("--group-size", type=int, default=SUPPRESS, help=f"samples per prompt (n) {default_help('group_size')}")
    p.add_argument("--max-tokens", type=int, default=SUPPRESS, help=f"completion length limit {default_help('max_tokens')}")
    p.add_argument("--temperature", type=float, default=SUPPRESS, help=default_help("temperature"))
    p.add_argument("--lr", type=float, default=SUPPRESS, help=default_help("lr"))


def _add_step_flags(p) -> None:
    """How a step overlaps, pushes, checks, saves, seeds and logs."""
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


def _add_device_flags(p) -> None:
    """Where the trainer runs, and the sidecar this run starts."""
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
    p.add_argument("--sidecar-quantization", default="none", choices=["none", "int8", "fp8", "auto"],
                   help="what that sidecar serves from (rollout.serve --quantization): an 8-bit copy derived from "
                        "the full-precision weights this run pushes; the sampling/* metrics show the mismatch "
                        "and --is-mode's importance weights correct for it")
    p.add_argument("--sidecar-head-dtype", default="auto", choices=["auto", "float32"],
                   help="float32: that sidecar's LM head in fp32 in a bf16/fp16 engine (rollout.serve --head-dtype), "
                        "as the trainer's fp32 head: on SmolLM2 the bf16 engine's tokens outside [0.9, 1.1] fell "
                        "7.7%% -> 5.2%% (bench.fidelity)")


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
    p.add_argument("--is-mode", default="token_truncate", choices=[*C.MODES, "none"],
                   help="how the loss corrects for the engine sampling from other probabilities than the trainer's "
                        "(recipes/corrections.py): truncated or masked importance weights per token or per "
                        "sequence (TRL's names), geometric_mask (verl's geometric rejection), icepop (Ring-1T's "
                        "IcePop), or none; mismatch/* logs how far apart the two are either way")
    p.add_argument("--is-cap", type=float, default=None,
                   help="the upper end of the correction's band (default the mode's: 2 for the token and sequence "
                        "modes, 1.001 for geometric_mask, 5 for icepop); 0: no correction, as --is-mode none")
    p.add_argument("--is-floor", type=float, default=None,
                   help="the lower end of a masking mode's band (default 1 / --is-cap; icepop 0.5)")
    p.add_argument("--on-policy", default="plain", choices=["plain", "exact"],
                   help="exact: the trainer's logprobs of each rollout are the engine's bit for bit (the sidecar's "
                        "engine rebuilt in the trainer's process, its values with torch's gradients: "
                        "recipes/exact_policy.py), so the importance weights are exactly 1; our engine on the CPU")
    p.add_argument("--routing-replay", action="store_true",
                   help="a mixture of experts: the trainer's forwards route every token to the experts the engine "
                        "routed it to (R3; recipes/routing_replay.py). Without it the routes are still asked for "
                        "and routing/mismatch logs the share of tokens the trainer routes otherwise")
    p.add_argument("--epochs", type=int, default=1, help="passes over each batch")
    p.add_argument("--minibatches", type=int, default=1, help="optimizer steps per pass")


def add_ray_args(p) -> None:
    """Sidecars on a Ray cluster (Ray is imported only with --ray)."""
    p.add_argument("--ray", action="store_true",
                   help="start the sidecars as Ray actors (rollout.ray_launcher) instead of one local process")
    p.add_argument("--ray-address", default=None,
                   help="cluster to join (auto: the one `ray start` runs here; default: RAY_ADDRESS, else a "
                        "local cluster for this run)")
    p.add_argument("--num-sidecars", type=int, default=1, help="sidecars on the cluster (each one engine)")
    p.add_argument("--placement", default="pack", choices=["pack", "spread"],
                   help="pack: as few nodes as fit; spread: one sidecar per node where possible")

