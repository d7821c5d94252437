"""Where a run's rollouts come from: a sidecar it starts (a local process, or Ray actors with
--ray), or one already running (--rollout-url); and the flags of the sidecar it starts."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("recipes")


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
    """The flags of the sidecar this run starts (after `--model`); `device` overrides where it runs.
    `args.sidecar_args`, when a recipe sets it: more flags (recipes.agent's HTTP front)."""
    return ["--max-model-len", "1024", "--log-level", "WARNING", "--stats-interval", "0", "--max-num-seqs", "128",
            "--device", device or sidecar_device(trainer_device, args.sidecar_device), "--seed", str(args.seed),
            "--engine", args.engine, "--dtype", getattr(args, "sidecar_dtype", "auto"),
            "--quantization", getattr(args, "sidecar_quantization", "none"),
            "--head-dtype", getattr(args, "sidecar_head_dtype", "auto"), *getattr(args, "sidecar_args", ())]


def seeds_requests(args, trainer_device: torch.device) -> bool:
    """Whether each request carries its own seed: not on vLLM's CPU build, where a seeded request
    fails (it would kill vLLM's engine core); --seed still seeds prompts, the trainer and the sidecar."""
    if args.engine == "vllm" and sidecar_device(trainer_device, args.sidecar_device) == "cpu":
        log.warning("--engine vllm on CPU: rollouts are not seeded per request (vLLM's CPU build cannot seed a "
                    "single request), so the same --seed no longer gives the same rollouts")
        return False
    return True


def rollout_source(args, model_dir: str, trainer_device: torch.device):
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
