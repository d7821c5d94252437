"""The RL algorithms of the recipes, one object each, chosen once by name (verl's registry of
algorithms rather than `if ppo` through the loop). An algorithm says what module trains, how
advantages come from rewards, and what it adds to the policy loss; the loop is the same."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from recipes import losses as L


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


class GRPO:
    """Group-relative advantages (DeepSeekMath), no critic."""

    name = "grpo"

    def __init__(self, args: argparse.Namespace):
        self.args = args

    @staticmethod
    def add_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-std-scale", action="store_true", help="Dr. GRPO: do not divide advantages by the std")

    def wrap(self, policy: torch.nn.Module) -> torch.nn.Module:
        return policy

    def policy_of(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    @property
    def single_pass(self) -> bool:
        """One optimizer step per batch is on-policy: the pre-update logprobs are those of the
        training forward, detached (as TRL does with num_iterations=1), one forward less."""
        return self.args.epochs == 1 and self.args.minibatches == 1

    def advantages(self, rewards: torch.Tensor, mask: torch.Tensor, old_values) -> tuple[torch.Tensor, None]:
        return L.grpo_advantages(rewards, self.args.group_size, not self.args.no_std_scale), None

    def extra_loss(self, values, old_values, returns, mask) -> torch.Tensor | None:
        return None


class PPO:
    """Token-level GAE on a learned value head (Schulman et al. 2017), clipped value loss."""

    name = "ppo"
    single_pass = False  # the values before the update are needed for GAE

    def __init__(self, args: argparse.Namespace):
        self.args = args

    @staticmethod
    def add_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--gamma", type=float, default=1.0, help="discount per token in the returns (1: none)")
        p.add_argument("--lam", type=float, default=0.95, help="GAE's lambda (1: Monte-Carlo returns, 0: one-step TD)")
        p.add_argument("--vf-coef", type=float, default=0.5, help="weight of the value loss beside the policy loss")
        p.add_argument("--value-clip", type=float, default=0.2,
                       help="the new value stays within this of the old one in the clipped value loss")

    def wrap(self, policy: torch.nn.Module) -> torch.nn.Module:
        return PolicyWithValue(policy)

    def policy_of(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.policy

    def advantages(self, rewards: torch.Tensor, mask: torch.Tensor,
                   old_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence reward lands on its last token; GAE over the masked values, whitened."""
        token_rewards = torch.zeros_like(mask)
        last = (mask.sum(1).long() - 1).clamp(min=0)
        token_rewards[torch.arange(len(rewards)), last] = rewards
        adv, returns = L.gae(token_rewards, old_values * mask, mask, self.args.gamma, self.args.lam)
        return L.whiten(adv, mask), returns

    def extra_loss(self, values, old_values, returns, mask) -> torch.Tensor:
        """The critic's clipped value loss (already weighted by vf_coef when added)."""
        return L.masked_mean(L.clipped_value_loss(values, old_values * mask, returns, mask, self.args.value_clip), mask)


ALGORITHMS = {cls.name: cls for cls in (GRPO, PPO)}
