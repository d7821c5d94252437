"""The sampler as pure functions: exact distribution, each logits processor against HF's (or a
hand computation), the processed-logprob contract with every processor, seeds."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampler import (
    Penalties,
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    block_size_for,
    counter_uniforms,
    inverse_cdf,
    mix32,
    sample,
    seed_key,
    uniform_noise,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3]])


def _tensors(n, temperature=1.0, top_k=None, top_p=None, min_p=None, seed=0, **kw) -> SamplingTensors:
    g = torch.Generator().manual_seed(seed)
    full = lambda v: None if v is None else torch.full((n,), v)  # noqa: E731
    return SamplingTensors(torch.full((n,), float(temperature)), full(top_k), full(top_p), full(min_p),
                           uniform_noise(g, n, "cpu"), any_greedy=temperature == 0, **kw)


def _draw(logits, n, **kw):
    tokens, logprobs, _ = sample(logits.expand(n, -1), _tensors(n, **kw))
    return tokens, logprobs


def _pvalue(tokens, probs, n):
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    keep = probs > 0
    assert observed[~keep].sum() == 0, "a zero-probability token was sampled"
    expected = probs.double()[keep] / probs.double()[keep].sum() * n
    return chisquare(observed[keep].numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_frequencies_match_the_distribution(temperature):
    n = 40000
    tokens, logprobs = _draw(LOGITS, n, temperature=temperature)
    probs = torch.softmax(LOGITS[0] / temperature, -1)
    assert _pvalue(tokens, probs, n) > 1e-3
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)


def test_chi_square_detects_a_wrong_distribution():
    """The test above can fail: the same check rejects samples from the wrong temperature."""
    n = 40000
    tokens, _ = _draw(LOGITS, n, temperature=1.0)
    assert _pvalue(tokens, torch.softmax(LOGITS[0] / 0.8, -1), n) < 1e-6


def test_inverse_cdf_resolves_tokens_far_below_float32_steps():
    """One token holds all but 2e-6 of the mass; 20000 tail tokens share the rest (1e-10
    each). Conditioned on landing in the tail (u drawn in it), the tail tokens must come out
    uniformly. A float32 uniform has only ~33 values in that range (steps of 6e-8), so most of
    the tail would never be sampled; the float64 uniforms here resolve each tail token."""
    vocab, tail = 20001, 1e-10
    weights = torch.full((vocab,), tail)
    weights[0] = 1.0
    head = 1.0 / float(weights.double().sum())
    n = 10000
    u = head + (1 - head) * (1 - torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(8)))
    idx = inverse_cdf(weights.expand(n, -1), u)
    assert bool((idx > 0).all())
    groups = (idx - 1) * 32 // (vocab - 1)
    assert _pvalue(groups, torch.ones(32), n) > 1e-3


@pytest.mark.parametrize("vocab", [4096, 5003])  # blocks divide it; padded
def test_inverse_cdf_frequencies_match_the_weights(vocab):
    gen = torch.Generator().manual_seed(vocab)
    weights = torch.rand(vocab, generator=gen) ** 4
    weights[torch.randperm(vocab, generator=gen)[:32]] += 10.0  # a head of 32 tokens, ~1/2 the mass
    n = 20000
    idx = inverse_cdf(weights.expand(n, -1), 1 - torch.rand(n, generator=gen))
    head = weights > 1
    label = torch.where(head, 32 + head.cumsum(0) - 1, torch.arange(vocab) * 32 // vocab)  # 32 tail groups, then the head
    probs = torch.zeros(64, dtype=torch.float64).index_add_(0, label, weights.double())
    assert _pvalue(label[idx], probs, n) > 1e-3


def test_inverse_cdf_never_picks_a_zero_weight():
    weights = torch.zeros(3, 5000)
    weights[0, 0] = 1.0  # first column only
    weights[1, -1] = 1.0  # last column only (a padded block follows it when 5000 is padded)
    weights[2, 1234] = 2.0
    weights[2, 4321] = 1e-30
    for u in (1.0, 1e-12, 0.5, float(torch.finfo(torch.float32).tiny)):
        assert inverse_cdf(weights, torch.full((3,), u)).tolist()[:2] == [0, 4999]
    picks = inverse_cdf(weights.expand(3, -1).clone(), torch.tensor([1.0, 1.0, 1.0]))
    assert picks[2] in (1234, 4321)


def test_block_size_divides_known_vocabularies():
    for vocab in (151936, 49152, 32000, 128256):
        assert vocab % block_size_for(vocab) == 0
    assert block_size_for(50257) == 1024  # no divisor nearby: padded


def test_top_k_never_leaves_the_kept_set():
    tokens, logprobs = _draw(LOGITS, 5000, top_k=3)
    assert set(tokens.tolist()) == {0, 1, 2}
    kept = torch.softmax(LOGITS[0, :3], -1)
    assert torch.allclose(logprobs, kept.log()[tokens], atol=1e-6)


def test_top_p_never_leaves_the_kept_set():
    probs = torch.softmax(LOGITS[0], -1)
    order = probs.argsort(descending=True)
    k = int((probs[order].cumsum(0) < 0.8).sum()) + 1  # smallest prefix reaching 0.8
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


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_masks_as_hf(min_p):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 2
    ours = apply_min_p(logits, torch.full((6,), min_p))
    theirs = MinPLogitsWarper(min_p)(None, logits.clone())
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    assert torch.equal(ours[torch.isfinite(ours)], logits[torch.isfinite(ours)])


def _penalties(prompt, output, vocab, repetition=1.0, presence=0.0, frequency=0.0) -> Penalties:
    counts = torch.zeros(1, vocab).index_add_(1, torch.tensor(output, dtype=torch.long), torch.ones(1, len(output)))
    mask = torch.zeros(1, vocab, dtype=torch.bool)
    mask[0, prompt] = True
    return Penalties(torch.tensor([repetition]), torch.tensor([presence]), torch.tensor([frequency]), counts, mask)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_as_hf(penalty):
    vocab = 40
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4)) * 3
    prompt, output = [1, 5, 5, 9], [9, 12, 30, 30]
    ours = apply_penalties(logits, _penalties(prompt, output, vocab, repetition=penalty))
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_presence_and_frequency_penalties_by_hand():
    vocab = 10
    logits = torch.zeros(1, vocab)
    prompt, output = [1, 2], [2, 3, 3, 3]
    ours = apply_penalties(logits, _penalties(prompt, output, vocab, presence=0.5, frequency=0.25))
    want = torch.zeros(vocab)
    want[2] = -0.5 - 0.25  # once in the output; the prompt does not count (OpenAI's definition)
    want[3] = -0.5 - 3 * 0.25
    torch.testing.assert_close(ours[0], want)


def test_the_processed_logprob_contract_holds_with_every_processor():
    """Penalties, temperature, min_p, top-k and top-p together: the samples follow the reference
    distribution (HF's processors in vLLM's order) and each reported logprob is that
    distribution's."""
    vocab, n = 30, 60000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 2
    prompt, output = [0, 1, 2, 3], [4, 4, 5]
    pen = _penalties(prompt, output, vocab, repetition=1.2, presence=0.3, frequency=0.2)
    ref = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([prompt + output]), logits.clone())
    ref = ref - 0.2 * pen.output_counts - 0.3 * (pen.output_counts > 0).float()
    for warper in (TemperatureLogitsWarper(0.7), MinPLogitsWarper(0.02), TopKLogitsWarper(20), TopPLogitsWarper(0.95)):
        ref = warper(None, ref)
    ref_logprobs = torch.log_softmax(ref[0], -1)
    rows = Penalties(*(x.expand(n, *x.shape[1:]) for x in (pen.repetition, pen.presence, pen.frequency)),
                     pen.output_counts.expand(n, -1), pen.prompt_mask.expand(n, -1))
    t = _tensors(n, temperature=0.7, top_k=20, top_p=0.95, min_p=0.02, penalties=rows)
    tokens, logprobs, _ = sample(logits.expand(n, -1), t)
    assert _pvalue(tokens, ref_logprobs.exp(), n) > 1e-3
    torch.testing.assert_close(logprobs, ref_logprobs[tokens], atol=1e-5, rtol=0)


def test_top_logprobs_are_the_top_of_the_reported_distribution():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(6))
    t = _tensors(4, temperature=0.5, num_top_logprobs=5)
    t.temperature[0] = 0.0  # a greedy row reports the raw distribution
    t.any_greedy = True
    tokens, logprobs, top = sample(logits, t)
    processed = torch.log_softmax(logits / 0.5, -1)
    raw = torch.log_softmax(logits, -1)
    for row in range(4):
        source = raw[row] if row == 0 else processed[row]
        want_values, want_ids = source.topk(5)
        assert top.ids[row].tolist() == want_ids.tolist()
        torch.testing.assert_close(top.values[row], want_values)
        torch.testing.assert_close(logprobs[row], source[tokens[row]])
        # the sampled token's rank: 1 + the tokens strictly more likely (its place in the sorted row)
        assert top.sampled_ranks[row] == source.sort(descending=True).indices.tolist().index(tokens[row]) + 1


def test_logprobs_zero_gives_ranks_and_no_top_tokens():
    logits = torch.randn(3, 60, generator=torch.Generator().manual_seed(8))
    tokens, logprobs, top = sample(logits, _tensors(3, temperature=1.0, num_top_logprobs=0, seed=3))
    assert top.ids.shape == (3, 0)
    processed = torch.log_softmax(logits, -1)
    assert top.sampled_ranks.tolist() == [int((processed[r] > processed[r, tokens[r]]).sum()) + 1 for r in range(3)]
    assert sample(logits, _tensors(3, temperature=1.0, seed=3))[2] is None  # logprobs=None: no ranks computed


def test_raw_logprobs_mode_reports_the_model_distribution():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(7))
    tokens, logprobs, _ = sample(logits, _tensors(3, temperature=0.3, top_k=5, raw_logprobs=True))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    t = _tensors(4)
    t.temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    t.any_greedy = True
    tokens, logprobs, _ = sample(logits, t)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0], -1).max())


def test_greedy_with_a_repetition_penalty_avoids_the_repeated_token():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    t = SamplingTensors(torch.zeros(1), penalties=_penalties([0], [], 3, repetition=1.2))
    tokens, logprobs, _ = sample(logits, t)
    assert tokens.tolist() == [1]
    torch.testing.assert_close(logprobs[0], torch.log_softmax(logits[0], -1)[1])  # the model's own logprob


def _counter(seeds: list[int], positions: list[int]) -> torch.Tensor:
    keys = np.array([seed_key(s) for s in seeds], dtype=np.int64)
    return torch.from_numpy(counter_uniforms(keys, np.array(positions, dtype=np.int64)))


def test_a_seeded_draw_depends_on_its_seed_and_position_alone():
    a = _counter([7, 42, 9], [0, 3, 1])
    b = _counter([42, 5, 5, 5], [3, 0, 0, 0])
    assert a[1] == b[0]  # same seed and position, another batch
    assert a[0] != a[2] and b[1] == b[2]
    assert _counter([42], [4])[0] != a[1]  # the next position draws anew
    assert _counter([42 + 2**32], [3])[0] != a[1]  # the seed's high half counts
    assert bool(((a > 0) & (a <= 1)).all())
    assert _counter([-1], [0])[0] == _counter([2**64 - 1], [0])[0]  # a seed is taken mod 2^64


def test_the_hash_is_the_same_on_ints_and_arrays_and_a_bijection():
    xs = np.random.default_rng(0).integers(0, 2**32, 1000, dtype=np.int64)
    assert mix32(xs).tolist() == [mix32(int(x)) for x in xs]
    assert np.unique(mix32(np.arange(2**16, dtype=np.int64))).size == 2**16  # no collisions on a dense range


def test_counter_uniforms_are_uniform_and_independent_across_positions_and_seeds():
    """Chi-square over 64 bins and lag-1 correlations, along positions (one seed) and along
    seeds (one position). Deterministic inputs; the bounds are ~5 standard deviations of an
    ideal generator (chi-square 63 dof: mean 63, sd 11.2; correlation sd 1/sqrt(n)), which a
    hash that leaks its counter (say u = position / n) fails by orders of magnitude."""
    n = 200_000
    along_positions = _counter([12345] * n, list(range(n)))
    along_seeds = _counter(list(range(10**12, 10**12 + n)), [0] * n)
    for u in (along_positions, along_seeds):
        counts = torch.bincount((u * 64).clamp(max=63.999).long(), minlength=64).double()
        chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
        assert chi2 < 63 + 5 * 11.2, chi2
        x = u - u.mean()
        corr = ((x[1:] * x[:-1]).mean() / x.var()).item()
        assert abs(corr) < 5 / n**0.5, corr
    assert abs(along_positions.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
