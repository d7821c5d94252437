"""recipes/corrections.py against hand-computed cases: each correction's weights and cuts on ratios
chosen to sit inside, on and past its band, and the mismatch measures against their formulas."""

import math

import pytest
import torch

from recipes import corrections as C

# trainer / engine probabilities of three sampled tokens in each of two sequences; the second row's
# last token is padding
TRAINER = torch.tensor([[0.5, 0.9, 0.1], [0.3, 0.3, 0.7]])
ENGINE = torch.tensor([[0.25, 0.9, 0.4], [0.3, 0.2, 0.1]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
RATIOS = [[2.0, 1.0, 0.25], [1.0, 1.5, 0.0]]  # r = trainer / engine, 0 off the mask (by hand)


def _log_r():
    return C.log_ratios(TRAINER.log(), ENGINE.log(), MASK)


def test_log_ratios_are_zero_off_the_mask():
    assert torch.exp(_log_r()).tolist()[1][2] == 1.0
    assert (torch.exp(_log_r()) * MASK).tolist() == [pytest.approx(row) for row in RATIOS]


def test_token_truncate_caps_each_ratio():
    c = C.correct("token_truncate", _log_r(), MASK, upper=1.5)
    assert c.weights.tolist() == [pytest.approx([1.5, 1.0, 0.25]), pytest.approx([1.0, 1.5, 0.0])]
    assert c.cut.tolist() == [[True, False, False], [False, False, False]]  # 1.5 is on the cap, not past it


def test_token_mask_drops_ratios_outside_the_band_and_keeps_the_rest_weighted():
    c = C.correct("token_mask", _log_r(), MASK, upper=1.6)  # lower: 1 / 1.6 = 0.625
    assert c.weights.tolist() == [pytest.approx([0.0, 1.0, 0.0]), pytest.approx([1.0, 1.5, 0.0])]
    assert c.cut.tolist() == [[True, False, True], [False, False, False]]


def test_icepop_is_the_token_mask_with_its_papers_band():
    c = C.correct("icepop", _log_r(), MASK)  # [0.5, 5]: 2.0 kept, 0.25 dropped
    assert c.weights.tolist() == [pytest.approx([2.0, 1.0, 0.0]), pytest.approx([1.0, 1.5, 0.0])]
    assert C.band("icepop") == (0.5, 5.0)


def test_sequence_modes_weigh_every_token_by_the_sequences_product():
    # R = 2 * 1 * 0.25 = 0.5 for the first sequence, 1 * 1.5 = 1.5 for the second (padding ignored)
    c = C.correct("sequence_truncate", _log_r(), MASK, upper=1.2)
    assert c.weights.tolist() == [pytest.approx([0.5, 0.5, 0.5]), pytest.approx([1.2, 1.2, 0.0])]
    assert c.cut.tolist() == [[False] * 3, [True, True, False]]
    m = C.correct("sequence_mask", _log_r(), MASK, upper=1.6, lower=0.6)
    assert m.weights.tolist() == [pytest.approx([0.0, 0.0, 0.0]), pytest.approx([1.5, 1.5, 0.0])]
    assert m.cut.tolist() == [[True] * 3, [False] * 3]


def test_geometric_mask_drops_sequences_whose_mean_log_ratio_leaves_the_band():
    # geometric means: 0.5 ** (1/3) = 0.794 and 1.5 ** (1/2) = 1.225
    c = C.correct("geometric_mask", _log_r(), MASK, upper=1.3, lower=0.8)
    assert c.weights.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    c = C.correct("geometric_mask", _log_r(), MASK, upper=1.3, lower=0.79)
    assert c.weights.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_a_long_sequences_ratio_stays_finite():
    log_r = torch.full((1, 400), 0.5)  # R = e^200: inf in fp32 without the cap
    mask = torch.ones(1, 400)
    for mode in ("sequence_truncate", "sequence_mask"):
        c = C.correct(mode, log_r, mask)
        assert torch.isfinite(c.weights).all() and c.cut.all()
    assert math.isfinite(C.mismatch(log_r, mask)["chi2_sequence"])


def test_bands_default_to_each_source_and_refuse_nonsense():
    assert C.band("token_truncate") == (0.5, 2.0)
    assert C.band("geometric_mask") == (pytest.approx(1 / 1.001), 1.001)
    assert C.band("token_mask", upper=4.0) == (0.25, 4.0)
    with pytest.raises(ValueError, match="unknown correction"):
        C.band("tis")
    with pytest.raises(ValueError, match="lower <= upper"):
        C.band("token_mask", upper=1.0, lower=2.0)


def test_mismatch_measures_by_hand():
    got = C.mismatch(_log_r(), MASK)
    real = [2.0, 1.0, 0.25, 1.0, 1.5]
    assert got["outside_band"] == pytest.approx(3 / 5)
    assert got["max_abs_log_ratio"] == pytest.approx(math.log(4))
    assert got["k3_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in real) / 5)
    assert got["chi2_token"] == pytest.approx(sum((r - 1) ** 2 for r in real) / 5)
    assert got["chi2_sequence"] == pytest.approx(((0.5 - 1) ** 2 + (1.5 - 1) ** 2) / 2)


def test_equal_policies_measure_zero_and_cut_nothing():
    lp = torch.log(torch.rand(4, 6).clamp(min=0.01))
    log_r = C.log_ratios(lp, lp, torch.ones(4, 6))
    assert all(v == 0 for v in C.mismatch(log_r, torch.ones(4, 6)).values())
    assert all(v == 0 for v in C.cut_shares(log_r, torch.ones(4, 6)).values())
