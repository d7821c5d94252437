"""Corrections for rollouts sampled by an engine whose probabilities are not the trainer's (a bf16 or
8-bit engine, vLLM, a trainer of its own), and the measures of how far apart the two are. Pure
functions of tensors; issue 65 item 4.

Shapes as in recipes/losses.py: B sequences, T completion tokens, `mask` [B, T] 1 on real tokens.
`log_r` is log(pi_trainer / pi_engine) per sampled token (the trainer's old-policy logprob minus the
engine's), 0 where the mask is 0. Each correction gives a weight per token that multiplies the
policy loss (0 drops the token), and which tokens it cut (truncated or dropped):

- `token_truncate`: min(r_t, upper) (truncated IS; TRL's `token_truncate`, verl's `rollout_is=token`).
- `token_mask`: r_t inside [lower, upper], else 0 (masked IS; verl's token rejection sampling; TRL's
  `token_mask` is the same with lower = 0).
- `sequence_truncate`: min(R, upper) on every token of the sequence, R = prod_t r_t = exp(sum_t log r_t)
  (TRL's `sequence_truncate`, verl's `rollout_is=sequence`).
- `sequence_mask`: R inside [lower, upper], else the whole sequence dropped (TRL's `sequence_mask`).
- `geometric_mask`: weight 1, or 0 for the whole sequence when its geometric mean ratio
  exp(mean_t log r_t) leaves [lower, upper] (verl's `rollout_rs=geometric`: length-free, so its band is
  narrow, 1.0002-1.001 in verl's docs).
- `icepop`: r_t inside [alpha, beta], else 0 (IcePop, Ring-1T: M(k) = k on [alpha, beta], 0 outside;
  the paper's band 0.5-5). The same formula as `token_mask`, with its paper's band.

The default bands are each method's source's; `lower` None means 1 / upper (verl's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask", "icepop")
# (lower, upper) by mode; lower None: 1 / upper
DEFAULT_BANDS = {"token_truncate": (None, 2.0), "token_mask": (None, 2.0), "sequence_truncate": (None, 2.0),
                 "sequence_mask": (None, 2.0), "geometric_mask": (None, 1.001), "icepop": (0.5, 5.0)}
# Past this, a sequence's summed log ratio is capped before exp: R = e^50 already exceeds any band
# and is finite in fp32 (e^89 is not), so a long sequence's ratio cannot turn into inf * 0 = nan.
MAX_SEQUENCE_LOG_RATIO = 50.0
MISMATCH_BAND = (0.9, 1.1)  # the share of tokens whose ratio leaves it: the figure bench.fidelity reports


@dataclass(frozen=True)
class Correction:
    weights: torch.Tensor  # [B, T] per-token weight on the loss, 0 on dropped and masked-out tokens
    cut: torch.Tensor  # [B, T] bool: real tokens whose weight is not their plain ratio (truncated, dropped)


def log_ratios(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi_trainer / pi_engine) per token, 0 off the mask."""
    return (trainer_logp - engine_logp) * mask


def band(mode: str, upper: float | None = None, lower: float | None = None) -> tuple[float, float]:
    """(lower, upper) for `mode`: the ones given, else the mode's default; a lower of None is 1 / upper."""
    if mode not in MODES:
        raise ValueError(f"unknown correction {mode!r}; expected one of {MODES}")
    default_lower, default_upper = DEFAULT_BANDS[mode]
    upper = default_upper if upper is None else upper
    lower = default_lower if lower is None else lower
    lower = 1.0 / upper if lower is None else lower
    if not 0 <= lower <= upper or upper <= 0:
        raise ValueError(f"a correction's band must have 0 <= lower <= upper and upper > 0, got [{lower}, {upper}]")
    return lower, upper


def correct(mode: str, log_r: torch.Tensor, mask: torch.Tensor, upper: float | None = None,
            lower: float | None = None) -> Correction:
    """The weights `mode` puts on each token (module docstring), in the band (default: the mode's)."""
    lower, upper = band(mode, upper, lower)
    real = mask.bool()
    if mode in ("token_truncate", "token_mask", "icepop"):
        r = torch.exp(log_r)
        if mode == "token_truncate":
            return Correction(r.clamp(max=upper) * mask, real & (r > upper))
        keep = (r >= lower) & (r <= upper)
        return Correction(r * keep * mask, real & ~keep)
    total = log_r.sum(dim=1, keepdim=True)  # log R per sequence
    if mode == "geometric_mask":
        geo = torch.exp(total / mask.sum(dim=1, keepdim=True).clamp(min=1))
        keep = (geo >= lower) & (geo <= upper)
        return Correction(keep.to(log_r.dtype) * mask, real & ~keep)
    seq = torch.exp(total.clamp(max=MAX_SEQUENCE_LOG_RATIO))
    if mode == "sequence_truncate":
        return Correction(seq.clamp(max=upper) * mask, real & (seq > upper))
    keep = (seq >= lower) & (seq <= upper)
    return Correction(seq * keep * mask, real & ~keep)


def mismatch(log_r: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's sampling is from the trainer's policy on these tokens (samples from the
    engine, r = pi_trainer / pi_engine): the share of tokens with r outside MISMATCH_BAND, max |log r|,
    the k3 estimate of KL(engine || trainer) (mean of r - 1 - log r, >= 0 per token), and the
    chi-square divergence chi2(trainer || engine) estimated per token (mean (r - 1)^2) and per sequence
    (mean over sequences of (R - 1)^2, its log R capped at MAX_SEQUENCE_LOG_RATIO)."""
    real = mask.bool()
    n = real.sum().clamp(min=1)
    r = torch.exp(log_r)
    low, high = MISMATCH_BAND
    seq = torch.exp(log_r.sum(dim=1).double().clamp(max=MAX_SEQUENCE_LOG_RATIO))  # squared: e^100, past fp32
    rows = real.any(dim=1)
    return {
        "outside_band": (((r < low) | (r > high)) & real).sum().item() / n.item(),
        "max_abs_log_ratio": log_r.abs().max().item() if real.any() else 0.0,
        "k3_kl": ((r - 1 - log_r) * mask).sum().item() / n.item(),
        "chi2_token": (((r - 1) ** 2) * mask).sum().item() / n.item(),
        "chi2_sequence": ((seq - 1) ** 2)[rows].mean().item() if rows.any() else 0.0,
    }


def cut_shares(log_r: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """For every mode at its default band, the share of real tokens it would cut on this batch: what
    switching to each would change, logged beside the one a run uses."""
    n = max(int(mask.sum().item()), 1)
    return {mode: correct(mode, log_r, mask).cut.sum().item() / n for mode in MODES}
