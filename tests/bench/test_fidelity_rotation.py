"""bench/fidelity.py's ablation rows: the Hadamard rotation is orthogonal (a rotated linear, unrounded, is
the same linear) and spreads an outlier, so rounding after it loses less (what the rows measure)."""

from __future__ import annotations

import pytest
import torch

from bench.fidelity import fake_quantized, hadamard_rotation


@pytest.mark.parametrize("k", [576, 1536, 96, 7])
def test_the_rotation_is_orthogonal_in_blocks_of_the_largest_power_of_two_dividing_k(k):
    r = hadamard_rotation(k).double()
    assert torch.allclose(r @ r.t(), torch.eye(k, dtype=torch.float64), atol=1e-6)
    block = k & -k  # 64 for 576, 512 for 1536, 32 for 96, 1 for 7
    assert (r[:block, block:] == 0).all() and (r[:block, :block] != 0).all()


def test_a_rotated_linear_unrounded_is_the_same_linear_and_rounding_after_it_loses_less():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 64, bias=False), torch.nn.Linear(64, 8))
    x = torch.randn(32, 256)
    x[:, 3] *= 100  # one outlier channel, as LLM activations have
    want = model(x)
    # fp32 sums of 256 terms turned by an orthogonal block: off by a few ulps of the largest term
    bound = 256 * 2.0**-22 * (x.abs() @ model[0].weight.abs().t()).amax()
    assert (fake_quantized(model, False, False, rotate=True)(x) - want).abs().max() <= bound * 8
    plain = (fake_quantized(model, False, True, 16)(x) - want).abs().mean()
    rotated = (fake_quantized(model, False, True, 16, rotate=True)(x) - want).abs().mean()
    assert rotated < plain / 2
