"""Losses and advantages for GRPO and PPO as pure functions of tensors (after verl's core_algos).

Shapes: B sequences, T completion tokens; `mask` [B, T] is 1 on real completion tokens.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ADV_EPS = 1e-4  # NOTE: TRL's GRPOTrainer adds this to the group std; the same value keeps the two comparable


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = ADV_EPS
                    ) -> torch.Tensor:
    """Group-normalised advantages: (r - mean of its group) [/ (std of its group + eps)], the std
    with Bessel's correction as TRL's. rewards: [B], consecutive runs of `group_size` samples form
    a group. Dr. GRPO turns the std scaling off."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over token-level rewards [B, T] and values [B, T].
    Masked positions contribute nothing and the value after the last real token is 0.
    Returns (advantages, returns), both [B, T] and zero where mask is 0."""
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * m
        adv[:, t] = last
        next_value = torch.where(m.bool(), values[:, t], next_value)
    returns = (adv + values) * mask
    return adv, returns


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", max_len: int | None = None
              ) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.
    token-mean: over every real token of the batch (DAPO);
    seq-mean-token-mean: mean per sequence, then over sequences (the original GRPO);
    seq-mean-token-sum-norm: per-sequence sum divided by a constant max_len (Dr. GRPO)."""
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.mean()
    if mode == "seq-mean-token-sum-norm":
        return ((loss * mask).sum(1) / (max_len or loss.shape[1])).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        clip_low: float = 0.2, clip_high: float = 0.2, is_weights: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token, with separate low/high clip (DAPO's clip-higher).
    advantages: [B, T] or [B] (broadcast over tokens). is_weights: optional per-token
    truncated importance weights (behaviour -> old policy) multiplying the loss.
    Returns (loss [B, T], clipped [B, T] as float: where the clipped branch was taken)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss = loss * is_weights
    return loss * mask, ((clipped > unclipped).float() * mask)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip: float = 0.2) -> torch.Tensor:
    """PPO's clipped value loss per token: 0.5 * max((v - R)^2, (clip(v) - R)^2)."""
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2) * mask


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
