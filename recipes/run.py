"""What a training run holds: the loop (recipes/rl_train.py) builds it once and the update
(recipes/policy_update.py) reads it."""

from __future__ import annotations

import argparse
import concurrent.futures
from dataclasses import dataclass

import torch


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
    sidecar: object | None  # the sidecars this run started, if any (recipes.rollout_source.LocalSidecars, RaySidecars)
    gen_client: object | None = None  # --async: a second client that generates while the first pushes
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    params: object = None  # engine.SamplingParams of every generate (seeded per request in _generate)
    seed_requests: bool = True  # False on vLLM's CPU build (seeds_requests)
    generate_calls: int = 0
    version: int = 0
    pending: concurrent.futures.Future | None = None  # --async: the next step's rollouts
    pushed: dict | None = None  # the last push's reply (rank 0): its bytes go in the step's metrics
    exact: object | None = None  # --on-policy exact: recipes.exact_policy.ExactPolicy
    router: object | None = None  # recipes.agent over several sidecars' fronts: rollout.launcher.LocalRouter
    prefix_seen: dict | None = None  # the sidecars' prefix-cache counters at the last step (recipes/prefix_metrics.py)
    routing_seen: list | None = None  # each sidecar's counters at the last step (recipes/routing_metrics.py)

    def policy(self) -> torch.nn.Module:
        return self.algo.policy_of(self.accelerator.unwrap_model(self.module))
