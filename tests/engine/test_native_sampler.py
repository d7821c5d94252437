"""engine/kernels/native_sampler.py (sampling's common case in C) against sampler.inverse_cdf on the same
uniforms: the same tokens, logprobs within the error its fp32 arithmetic allows, no zero weight ever
picked, the tail resolved as finely as the float64 uniform allows, and sample() taking it only when
a step asks for nothing but sampling."""

import math

import pytest
import torch
from scipy.stats import chisquare

from engine.kernels import native_sampler
from engine.sampler import SamplingTensors, block_size_for, inverse_cdf, sample

native = pytest.mark.skipif(
    native_sampler.sample_rows(torch.zeros(1, 4), torch.ones(1), torch.ones(1, dtype=torch.float64), 4) is None,
    reason="no C compiler for the native kernels")


def _case(rows, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    temperature = torch.rand(rows, generator=g) + 0.3
    u = 1.0 - torch.rand(rows, generator=g, dtype=torch.float64)
    return logits, temperature, u


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(256, 49152), (5, 151936), (9, 5003), (33, 50)])
def test_the_same_tokens_as_inverse_cdf_and_logprobs_within_fp32s_error(dtype, rows, vocab):
    logits, temperature, u = _case(rows, vocab, dtype, rows + vocab)
    tokens, logprobs = native_sampler.sample_rows(logits, temperature, u, block_size_for(vocab))
    scaled = logits.float() / temperature[:, None]  # rounded as both paths divide
    assert torch.equal(tokens, inverse_cdf(torch.softmax(scaled, -1), u))
    exact = torch.log_softmax(scaled.double(), -1).gather(-1, tokens[:, None])[:, 0]
    # each weight e^(s - max): s - max rounded in fp32 (2^-24 of |s - max|, an absolute error of the
    # exponent) and e^x within 2 ulps (2^-22); the log of the weight and of the total (a mean of such
    # errors) both carry it; then the logprob's own rounding to fp32
    spread = (scaled - scaled.amax(-1, keepdim=True)).abs().amax(-1).double()
    bound = 2 * (spread * 2.0**-24 + 2.0**-22) + exact.abs() * 2.0**-24
    assert ((logprobs.double() - exact).abs() <= bound).all()


@native
def test_a_zero_weight_is_never_picked():
    logits = torch.full((3, 5000), -math.inf)
    logits[0, 0] = 0.0  # first column only
    logits[1, -1] = 0.0  # last column only
    logits[2, 1234], logits[2, 4321] = 0.0, -80.0  # e^-80: positive, far below the other
    for u in (1.0, 1e-12, 0.5, float(torch.finfo(torch.float64).tiny)):
        tokens, logprobs = native_sampler.sample_rows(logits, torch.ones(3), torch.full((3,), u, dtype=torch.float64),
                                                      block_size_for(5000))
        assert tokens[:2].tolist() == [0, 4999] and tokens[2] in (1234, 4321)
        assert logprobs[:2].tolist() == [0.0, 0.0]


@native
def test_the_tail_is_resolved_below_float32_steps():
    """As test_sampler's inverse_cdf test: one token holds all but 2e-6 of the mass, 20000 share the
    rest; conditioned on the tail, they come out uniformly."""
    vocab = 20001
    logits = torch.full((vocab,), math.log(1e-10))
    logits[0] = 0.0
    weights = logits.double().exp()
    head = float(weights[0] / weights.sum())
    n = 10000
    u = head + (1 - head) * (1 - torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(8)))
    tokens, _ = native_sampler.sample_rows(logits.expand(n, -1), torch.ones(n), u, block_size_for(vocab))
    assert bool((tokens > 0).all())
    counts = torch.bincount((tokens - 1) * 32 // (vocab - 1), minlength=32).double()
    assert chisquare(counts.numpy()).pvalue > 1e-3


@native
def test_sample_takes_it_only_for_a_step_that_only_samples(monkeypatch):
    logits, temperature, u = _case(8, 1000, torch.float32, 1)
    only = SamplingTensors(temperature, uniforms=u, any_greedy=False)
    calls = []
    real = native_sampler.sample_rows
    monkeypatch.setattr(native_sampler, "sample_rows", lambda *a: calls.append(1) or real(*a))
    tokens, logprobs, top = sample(logits, only)
    assert calls and top is None
    assert torch.equal((tokens, logprobs)[0], real(logits, temperature, u, block_size_for(1000))[0])
    calls.clear()
    with_top_k = SamplingTensors(temperature, top_k=torch.full((8,), 5), uniforms=u, any_greedy=False)
    sample(logits, with_top_k)
    asked_top = SamplingTensors(temperature, uniforms=u, any_greedy=False, num_top_logprobs=2)
    assert sample(logits, asked_top)[2] is not None
    assert not calls
