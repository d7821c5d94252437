"""Sampling as pure functions of (logits, per-row parameters, one uniform draw per row).

Processing order (vLLM's): the logits processors (allowed tokens, bad words, min_tokens, logit
bias: engine/logits_processors.py), penalties, then temperature, then min_p, then top-k / top-p. The returned logprob of a sampled token is taken from the distribution it was
sampled from, i.e. after all of that ("processed", the default; what an RL trainer needs as the
behaviour policy). With `raw_logprobs` it is log_softmax of the model's own logits instead.
Greedy rows (temperature 0) take the argmax of the penalised logits and report the raw model
logprob, since their sampling distribution is a point mass.

Sampling is inverse-CDF from one uniform per row, so a step costs O(batch) random draws, not
O(batch x vocab). It is exact to float32 rounding of the probabilities themselves: the uniform
is float64 (a float32 one has 2^-24 steps, so every token's chance would be a multiple of
6e-8: off by ~1e-3 in total variation over a 152k vocabulary), the row is cut into blocks, the
block is chosen from (pairwise, accurate) float32 block sums summed in float64, and the token
from a float64 cumulative sum inside that block. Each token's probability is thus off by a
relative ~1e-7 at most, never by an absolute amount set by the vocabulary's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.kernels import native_sampler
from engine.logits_processors import LogitsEdits, apply_edits
from engine.seeded_draws import counter_uniforms, mix32, seed_key  # noqa: F401 - sampling's names


@dataclass
class SamplingTensors:
    """One step's per-row parameters, on the logits' device; None where no row uses an option."""

    temperature: torch.Tensor  # [B], 0 means greedy
    top_k: torch.Tensor | None = None  # [B] int, 0 is off
    top_p: torch.Tensor | None = None  # [B], 1 is off
    min_p: torch.Tensor | None = None  # [B], 0 is off
    uniforms: torch.Tensor | None = None  # [B] float64 in (0, 1]; None when every row is greedy
    any_greedy: bool = True  # known on the host: no device sync to branch on it
    penalties: Penalties | None = None
    edits: LogitsEdits | None = None
    num_top_logprobs: int | None = None  # the most top logprobs any row asked for; None: no row asked
    raw_logprobs: bool = False
    # [B] bool on the host: rows sampled at their temperature alone (step_sampling.plain_row), whose
    # token and logprob must not depend on what their neighbours ask; None: no row is, or every row is
    plain: torch.Tensor | None = None
    asks_top: torch.Tensor | None = None  # [B] bool: the rows that asked for top logprobs; None: none did


@dataclass
class TopLogprobs:
    """Per row: the K most likely tokens' logprobs and ids, and the sampled token's rank (1 = most
    likely), all in the distribution the sampled logprob is reported from."""

    values: torch.Tensor  # [B, K]
    ids: torch.Tensor  # [B, K]
    sampled_ranks: torch.Tensor  # [B]


@dataclass
class Penalties:
    """vLLM's penalties, per row [B]; counts of each row's output tokens [B, V]; a mask of the
    tokens in each row's prompt [B, V]."""

    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    output_counts: torch.Tensor
    prompt_mask: torch.Tensor


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition penalty on every token seen (prompt or output): a positive logit is divided by
    it, a negative one multiplied (HF's and vLLM's rule); then frequency (per occurrence) and
    presence (once) penalties, output tokens only (OpenAI's and vLLM's definition)."""
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = p.repetition.unsqueeze(-1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - p.frequency.unsqueeze(-1) * p.output_counts
    return logits - p.presence.unsqueeze(-1) * (p.output_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the most likely token's (0 is off).
    In log space: logit < max_logit + log(min_p)."""
    if min_p is None:
        return logits
    floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p).unsqueeze(-1)
    return logits.masked_fill(logits < floor, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k and then top-p set. top_k 0 / top_p 1 are off.

    top-p keeps the smallest set of most likely tokens whose probability reaches top_p
    (always at least the most likely token), as vLLM does.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))  # the k-th largest value
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(-1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def uniform_noise(shared: torch.Generator, rows: int, device) -> torch.Tensor:
    """One uniform in (0, 1] per row from the shared generator (rows without a seed of their
    own; seeded rows draw from counter_uniforms)."""
    return 1.0 - torch.rand(rows, device=device, generator=shared, dtype=torch.float64)  # rand is in [0, 1)


def block_size_for(vocab: int) -> int:
    """Columns per block: a divisor of the vocabulary near sqrt(V) when there is one (no padding
    copy), else 1024. Small blocks keep the in-block float64 cumsum cheap."""
    target = max(64, math.isqrt(vocab))
    for size in range(target, min(vocab, 4 * target) + 1):
        if vocab % size == 0:
            return size
    return min(vocab, 1024)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i of each row with probability weights[i] / sum(weights) (weights >= 0, each row
    with some positive weight), from one uniform u in (0, 1] per row. A zero weight is never
    chosen."""
    rows, vocab = weights.shape
    size = block_size_for(vocab)
    pad = -vocab % size
    w = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    blocks = w.view(rows, -1, size)
    block_cum = blocks.sum(dim=-1).double().cumsum(dim=-1)  # pairwise block sums: accurate
    target = u.double() * block_cum[:, -1]
    j = torch.searchsorted(block_cum, target.unsqueeze(-1)).squeeze(-1).clamp_(max=block_cum.shape[1] - 1)
    before = torch.where(j > 0, block_cum.gather(-1, (j - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    mass = block_cum.gather(-1, j.unsqueeze(-1)).squeeze(-1) - before
    # where the target falls inside block j, as a fraction of it: (0, 1]
    frac = ((target - before) / mass).clamp_(min=torch.finfo(torch.float64).tiny, max=1.0)
    chosen = blocks[torch.arange(rows, device=w.device), j].double().cumsum(dim=-1)
    i = torch.searchsorted(chosen, (frac * chosen[:, -1]).unsqueeze(-1)).squeeze(-1).clamp_(max=size - 1)
    return j * size + i


def sample(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, TopLogprobs | None]:
    """Sample one token per row from the model's logits [B, V].

    Returns (token ids [B], their logprobs [B], top): top holds the K = t.num_top_logprobs most
    likely tokens and the sampled one's rank, from the distribution the logprob is reported
    from; None when no row asked for logprobs.
    """
    if _only_sampling(t):
        native = native_sampler.sample_rows(logits, t.temperature, t.uniforms, block_size_for(logits.shape[-1]))
        if native is not None:
            return *native, None
    tokens, logprobs, top = sample_with_torch(logits, t)
    if t.plain is not None and not t.raw_logprobs and logits.device.type == "cpu":
        _plain_rows_native(logits, t, tokens, logprobs)
    return tokens, logprobs, top


def _plain_rows_native(logits: torch.Tensor, t: SamplingTensors, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """The plain rows of a step that also holds others take the native sampler's token and logprob,
    as in a step of plain rows alone: a row's bits never depend on what its neighbours ask (batch
    invariance; the trainer's exact logprobs score with the native arithmetic)."""
    rows = t.plain.nonzero().squeeze(-1)
    if rows.numel() == 0:
        return
    native = native_sampler.sample_rows(logits.index_select(0, rows), t.temperature.index_select(0, rows),
                                        t.uniforms.index_select(0, rows), block_size_for(logits.shape[-1]))
    if native is not None:
        tokens[rows], logprobs[rows] = native


def sample_with_torch(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, TopLogprobs | None]:
    """`sample` in torch ops, every option (what it runs on a GPU, and on the CPU for steps that ask
    for more than sampling)."""
    logits = logits.float()
    steered = apply_edits(logits, t.edits)
    if t.penalties is not None:
        steered = apply_penalties(steered, t.penalties)
    greedy = t.temperature == 0
    if t.uniforms is None:
        tokens = steered.argmax(dim=-1)
        raw = torch.log_softmax(logits, dim=-1)
        return tokens, *_chosen(raw, tokens, t.num_top_logprobs)
    temp = torch.where(greedy, torch.ones_like(t.temperature), t.temperature)
    scaled = apply_top_k_top_p(apply_min_p(steered / temp.unsqueeze(-1), t.min_p), t.top_k, t.top_p)
    probs = torch.softmax(scaled, dim=-1)
    tokens = inverse_cdf(probs, t.uniforms)
    if t.any_greedy:
        tokens = torch.where(greedy, steered.argmax(dim=-1), tokens)
    # a sampled row's processed logprob, the log of its token's probability: far above float32's
    # underflow, so the log loses nothing a log_softmax would keep
    own = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()
    if t.raw_logprobs or t.any_greedy or t.num_top_logprobs is not None:  # whole log-distributions needed
        raw = torch.log_softmax(logits, dim=-1) if t.raw_logprobs or t.any_greedy else None
        source = raw if t.raw_logprobs else torch.log_softmax(scaled, dim=-1)
        if t.any_greedy and not t.raw_logprobs:
            source = torch.where(greedy.unsqueeze(-1), raw, source)
        chosen, top = _chosen(source, tokens, t.num_top_logprobs)
        if not t.raw_logprobs:  # each row by its own rule, whatever its neighbours asked (batch invariance)
            by_source = greedy if t.asks_top is None else greedy | t.asks_top
            chosen = torch.where(by_source, chosen, own)
        return tokens, chosen, top
    return tokens, own, None


def _only_sampling(t: SamplingTensors) -> bool:
    """Whether a step only samples (an RL rollout's: no processors, penalties, filters, greedy rows
    or whole distributions asked), what engine/kernels/native_sampler.py does in one call."""
    return (t.uniforms is not None and not t.any_greedy and t.edits is None and t.penalties is None
            and t.min_p is None and t.top_k is None and t.top_p is None and t.num_top_logprobs is None
            and not t.raw_logprobs)


def _chosen(logprobs: torch.Tensor, tokens: torch.Tensor, k: int | None) -> tuple[torch.Tensor, TopLogprobs | None]:
    """The chosen tokens' logprobs [B] and, when k is not None, the top k and their ranks."""
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if k is None:
        return chosen, None
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return chosen, TopLogprobs(values, ids, token_ranks(logprobs, chosen))


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each row's rank of a token whose logprob is `chosen` [B]: 1 + how many tokens are more
    likely (vLLM's rule, ties share the better rank)."""
    return (logprobs > chosen.unsqueeze(-1)).sum(dim=-1) + 1
