"""Where a run's rollouts come from: sidecars it starts (local processes, --sidecars N; or Ray actors with
--ray), or ones already running (--rollout-url); and the flags of the sidecars it starts."""

from __future__ import annotations

import concurrent.futures
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


# The sidecar's running batch. recipes/exact_policy.py's scorer takes the same: on a CPU with AVX512-BF16 and no
# AMX, a bf16 engine's kernels depend on it (engine/kernels/bf16_rows.py: in place up to 64 sequences), and
# the scorer must sum as the sidecar does.
SIDECAR_MAX_NUM_SEQS = 128


def sidecar_command(args, model_dir: str, trainer_device: torch.device, device: str | None = None) -> list[str]:
    """The flags of the sidecar this run starts (after `--model`); `device` overrides where it runs.
    `args.sidecar_args`, when a recipe sets it: more flags (recipes.agent's HTTP front)."""
    return ["--max-model-len", "1024", "--log-level", "WARNING", "--stats-interval", "0",
            "--max-num-seqs", str(SIDECAR_MAX_NUM_SEQS),
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


class LocalSidecars:
    """The local sidecars a run started (--sidecars N), as one: their ZMQ `urls` and HTTP fronts' `http_urls`."""

    def __init__(self, model_dir: str, n: int, flags: list[str], token: str, prefixes: list[list[str]] | None = None):
        """`prefixes`: a command each sidecar runs under (LocalSidecar's `prefix`), e.g. taskset."""
        from rollout.launcher import LocalSidecar

        prefixes = prefixes or [[]] * n
        with concurrent.futures.ThreadPoolExecutor(n) as pool:  # they import torch and load the model at once
            started = [pool.submit(LocalSidecar, model_dir, *flags, token=token, prefix=prefixes[k]) for k in range(n)]
        self.all = []
        for f in started:
            try:
                self.all.append(f.result())
            except Exception:
                self.stop()
                raise

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.all]

    @property
    def http_urls(self) -> list[str]:
        return [s.http_url for s in self.all if s.http_url]

    def stop(self) -> None:
        for s in self.all:
            s.stop()


def rollout_source(args, model_dir: str, trainer_device: torch.device):
    """A connected RolloutClient, the sidecars we started (or None), and the URLs of the sidecars."""
    from rollout import RolloutClient

    sidecar = None
    url = args.rollout_url.split(",") if args.rollout_url else None
    if args.sidecars < 1 or args.sidecars > 1 and (url or args.ray):
        raise ValueError("--sidecars N starts N >= 1 local sidecars: not with --rollout-url or --ray (--num-sidecars)")
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
        sidecar = LocalSidecars(model_dir, args.sidecars, sidecar_command(args, model_dir, trainer_device), args.token)
        url = sidecar.urls
    return RolloutClient(url, token=args.token), sidecar, url
