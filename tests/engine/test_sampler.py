"""The sampler as pure functions: exact distribution, top-k / top-p sets, seeds."""

import pytest
import torch
from scipy.stats import chisquare

from engine.sampler import apply_top_k_top_p, exponential_noise, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3]])


def _draw(logits, n, temperature=1.0, top_k=None, top_p=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = logits.expand(n, -1)
    noise = exponential_noise(n, logits.shape[-1], [None] * n, g, "cpu")
    tk = None if top_k is None else torch.full((n,), top_k)
    tp = None if top_p is None else torch.full((n,), top_p)
    return sample(rows, torch.full((n,), temperature), tk, tp, noise)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_frequencies_match_the_distribution(temperature):
    n = 40000
    tokens, logprobs = _draw(LOGITS, n, temperature)
    probs = torch.softmax(LOGITS[0] / temperature, -1)
    observed = torch.bincount(tokens, minlength=8).double()
    assert chisquare(observed.numpy(), (probs.double() / probs.double().sum() * n).numpy()).pvalue > 1e-3
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)


def test_chi_square_detects_a_wrong_distribution():
    """The test above can fail: the same check rejects samples from the wrong temperature."""
    n = 40000
    tokens, _ = _draw(LOGITS, n, 1.0)
    wrong = torch.softmax(LOGITS[0] / 0.8, -1)
    observed = torch.bincount(tokens, minlength=8).double()
    assert chisquare(observed.numpy(), (wrong.double() / wrong.double().sum() * n).numpy()).pvalue < 1e-6


def test_top_k_never_leaves_the_kept_set():
    tokens, logprobs = _draw(LOGITS, 5000, top_k=3)
    assert set(tokens.tolist()) == {0, 1, 2}
    kept = torch.softmax(LOGITS[0, :3], -1)
    assert torch.allclose(logprobs, kept.log()[tokens], atol=1e-6)


def test_top_p_never_leaves_the_kept_set():
    probs = torch.softmax(LOGITS[0], -1)
    order = probs.argsort(descending=True)
    # smallest prefix reaching 0.8
    k = int((probs[order].cumsum(0) < 0.8).sum()) + 1
    tokens, _ = _draw(LOGITS, 5000, top_p=0.8)
    assert set(tokens.tolist()) == set(order[:k].tolist())


def test_top_p_keeps_at_least_the_top_token():
    tokens, logprobs = _draw(LOGITS, 200, top_p=1e-6)
    assert set(tokens.tolist()) == {0}
    assert torch.allclose(logprobs, torch.zeros(200))


def test_top_k_then_top_p_masking():
    masked = apply_top_k_top_p(LOGITS.clone(), torch.tensor([4]), torch.tensor([0.85]))
    kept = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert kept == [0, 1, 2]  # top-4 is {0,1,2,7}; renormalised over it, {0,1,2} hold 0.897 >= 0.85


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    noise = torch.empty(4, 50).exponential_()
    tokens, logprobs = sample(logits, torch.tensor([0.0, 1.0, 0.0, 1.0]), None, None, noise)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0], -1).max())


def test_seeded_rows_ignore_the_rest_of_the_batch():
    shared_a, shared_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    gen = lambda: torch.Generator().manual_seed(42)  # noqa: E731
    a = exponential_noise(3, 10, [None, gen(), None], shared_a, "cpu")
    b = exponential_noise(5, 10, [None, None, None, None, gen()], shared_b, "cpu")
    assert torch.equal(a[1], b[4])
    assert not torch.equal(a[0], b[0])
