"""Losses and advantages against hand-computed values."""

import math

import pytest
import torch

from recipes import losses as L


def test_grpo_advantages_normalise_within_groups():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = L.grpo_advantages(r, 4)
    std = math.sqrt(1 / 3) + L.ADV_EPS  # unbiased (Bessel) std of 1 0 0 1, plus TRL's epsilon
    assert adv[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-6)
    assert adv[4:].tolist() == [0.0] * 4  # a group with equal rewards teaches nothing
    dr = L.grpo_advantages(r, 4, scale_by_std=False)
    assert dr[:4].tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError):
        L.grpo_advantages(r, 3)


def test_gae_by_hand():
    # one sequence of 3 tokens, reward 1 at the end, values .5 .6 .7, gamma .9, lambda .8
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])  # the padded position must be ignored
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = L.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.9 * 0.8 * a2
    a0 = d0 + 0.9 * 0.8 * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2, 0.0])
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7, 0.0])


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))  # ratios
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0])
    loss, clipped = L.clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # A>0: -min(r*A, clip(r)*A): r=1.5 -> clipped at 1.28; r=.5 -> .5 (unclipped smaller); r=1.1 -> 1.1
    assert loss[0].tolist() == pytest.approx([-1.28, -0.5, -1.1, 0.0])
    assert clipped[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    loss, clipped = L.clipped_policy_loss(logp, old, -adv, mask, clip_low=0.2, clip_high=0.28)
    # A<0: -min(-r, -clip(r)) = max(r, clip(r)): r=.5 -> .8 (clip_low)
    assert loss[0].tolist() == pytest.approx([1.5, 0.8, 1.1, 0.0])
    assert clipped[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    w = torch.tensor([[2.0, 1.0, 0.5, 1.0]])
    weighted, _ = L.clipped_policy_loss(logp, old, adv, mask, 0.2, 0.28, is_weights=w)
    assert weighted[0].tolist() == pytest.approx([-2.56, -0.5, -0.55, 0.0])


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert L.aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert L.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert L.aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError):
        L.aggregate(loss, mask, "nope")


def test_k3_kl_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.2]))
    kl = L.k3_kl(logp, ref)
    r = 0.25 / 0.5
    assert kl.tolist() == pytest.approx([r - math.log(r) - 1, 0.0])
    assert (L.k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.5]])
    returns = torch.tensor([[0.0, 1.0]])
    mask = torch.ones(1, 2)
    out = L.clipped_value_loss(values, old, returns, mask, clip=0.2)
    # token 0: v=1 -> (1-0)^2=1, clipped v=.7 -> .49; max 1 -> .5 ; token 1: v=0 -> 1, clipped .3 -> .49 -> .5
    assert out[0].tolist() == pytest.approx([0.5, 0.5])


def test_whiten_and_entropy():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = L.whiten(x, m)
    assert L.masked_mean(w, m).item() == pytest.approx(0, abs=1e-6) and w[0, 3] == 0
    uniform = torch.zeros(1, 8)
    assert L.entropy_from_logits(uniform).item() == pytest.approx(math.log(8), rel=1e-6)
