"""vLLM's logits processors as pure functions, against HF's processors on the same logits and
histories: bad words, min_tokens, logit bias, allowed tokens; and the processed-logprob
contract when they are on."""

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine.logits_processors import apply_edits, bad_word_bans, build_edits, sequence_bans
from engine.sampler import SamplingTensors, sample, uniform_noise

VOCAB = 40


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _hf(processor, history: list[int], logits: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([history]), logits.clone().unsqueeze(0))[0]


def test_bad_word_bans_by_hand():
    words = [[5], [7, 8], [1, 2, 3]]
    assert bad_word_bans([], words) == [5]  # a one-token word is always banned
    assert bad_word_bans([9, 7], words) == [5, 8]
    assert bad_word_bans([1, 2], words) == [5, 3]
    assert bad_word_bans([2], words) == [5]  # [1, 2, 3] needs both of its first tokens
    assert bad_word_bans([7, 9], words) == [5]


@pytest.mark.parametrize("seed", range(5))
def test_bad_words_mask_as_hf(seed):
    g = torch.Generator().manual_seed(seed)
    words = [[int(t) for t in torch.randint(3, VOCAB, (n,), generator=g)] for n in (1, 2, 2, 3)]
    history = [int(t) for t in torch.randint(3, VOCAB, (6,), generator=g)]
    history[-1:] = words[1][:1]  # the output ends with a bad word's prefix
    history[-3:-1] = words[3][:2]
    logits = _logits(1, seed)
    edits = build_edits([(None, bad_word_bans(history, words), None)], VOCAB, "cpu")
    ours = apply_edits(logits, edits)[0]
    theirs = _hf(NoBadWordsLogitsProcessor(words, eos_token_id=0), history, logits[0])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert torch.isinf(ours).sum() >= 2


@pytest.mark.parametrize("made", [0, 2, 3, 5])
def test_min_tokens_masks_stop_tokens_as_hf(made):
    prompt, stops = [11, 12, 13], (0, 4)
    output = list(range(20, 20 + made))
    logits = _logits(1, made)
    edits = build_edits([(None, sequence_bans(made, 3, stops, output, []), None)], VOCAB, "cpu")
    ours = apply_edits(logits, edits)[0]
    theirs = _hf(MinNewTokensLengthLogitsProcessor(len(prompt), 3, list(stops)), prompt + output, logits[0])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert torch.isinf(ours).any() == (made < 3)


def test_logit_bias_adds_as_hf_sequence_bias():
    bias = {3: 2.5, 17: -4.0, 30: 100.0}
    logits = _logits(1, 9)
    ours = apply_edits(logits, build_edits([(None, [], bias)], VOCAB, "cpu"))[0]
    theirs = _hf(SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}), [1, 2], logits[0])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_allowed_token_ids_mask_as_hf_prefix_constraint():
    allowed = [2, 9, 33]
    logits = _logits(1, 10)
    ours = apply_edits(logits, build_edits([(allowed, [], None)], VOCAB, "cpu"))[0]
    theirs = _hf(PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, num_beams=1), [1, 2], logits[0])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_edits_apply_per_row_and_leave_the_input_alone():
    logits = _logits(3, 11)
    before = logits.clone()
    rows = [([1, 2], [], None), (None, [5], {6: 1.0}), (None, (), None)]
    out = apply_edits(logits, build_edits(rows, VOCAB, "cpu"))
    assert torch.equal(logits, before)
    assert torch.isfinite(out[0]).sum() == 2 and torch.equal(out[0, [1, 2]], logits[0, [1, 2]])
    assert out[1, 5] == float("-inf") and out[1, 6] == logits[1, 6] + 1.0
    assert torch.equal(out[2], logits[2])
    assert build_edits([(None, [], None)] * 3, VOCAB, "cpu") is None  # nothing asked: nothing built


def test_processed_logprobs_come_from_the_edited_distribution():
    """A sampled token's logprob is from the distribution it was drawn from: bias and bans
    included (the behaviour policy an RL trainer divides by)."""
    logits = _logits(1, 12).expand(2000, -1).contiguous()
    edits = build_edits([(None, [0, 1], {2: 3.0})] * 2000, VOCAB, "cpu")
    t = SamplingTensors(torch.full((2000,), 0.8), uniforms=uniform_noise(torch.Generator().manual_seed(1), 2000, "cpu"), any_greedy=False, edits=edits)
    tokens, logprobs, _ = sample(logits, t)
    edited = logits[0].clone()
    edited[[0, 1]] = float("-inf")
    edited[2] += 3.0
    want = torch.log_softmax(edited / 0.8, -1)
    assert not ({0, 1} & set(tokens.tolist()))
    torch.testing.assert_close(logprobs, want[tokens], atol=1e-5, rtol=0)
    kept = want.exp() > 0  # the draws follow the edited distribution (a chi-square test)
    observed = torch.bincount(tokens, minlength=VOCAB).double()[kept]
    assert chisquare(observed.numpy(), (want.double().exp()[kept] / want.double().exp()[kept].sum() * 2000).numpy()).pvalue > 1e-3
