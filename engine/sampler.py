"""Sampling as pure functions of (logits, per-row parameters, noise).

The returned logprob of a sampled token is taken from the distribution it was sampled from:
log_softmax(logits / temperature) restricted to the top-k / top-p set and renormalised
("processed", the default; what an RL trainer needs as the behaviour policy). With
`logprobs_mode="raw"` it is log_softmax of the unscaled logits instead. Greedy rows
(temperature 0) always report the raw model logprob, since their sampling distribution is a
point mass.
"""

from __future__ import annotations

import torch


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


def exponential_noise(
    batch: int, vocab: int, generators: list[torch.Generator | None], shared: torch.Generator, device
) -> torch.Tensor:
    """Exp(1) noise per row, drawn on `device` (the generators live there too); a row with its
    own generator draws from it alone, so its samples do not depend on the rest of the batch.
    A seed gives the same tokens on every machine of one device type (CPU and CUDA generators
    are different streams)."""
    noise = torch.empty(batch, vocab, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == batch:
        noise.exponential_(generator=shared)
    elif unseeded:  # draw only the rows that need it: seeded rows draw vocab-sized noise anyway
        noise[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    noise: torch.Tensor | None,
    raw_logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (token ids [B], logprobs [B]).

    logits: [B, V] float32. temperature: [B], 0 means greedy. noise: [B, V] Exp(1) draws, or
    None when every row is greedy. Sampling is the exponential race argmax(p / E), which draws
    exactly from p (it is the Gumbel-max trick in another form).
    """
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    greedy = temperature == 0
    if bool(greedy.all()):
        tokens = logits.argmax(dim=-1)
        return tokens, raw.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    processed = torch.log_softmax(apply_top_k_top_p(logits / t.unsqueeze(-1), top_k, top_p), dim=-1)
    sampled = (processed.exp() / noise).argmax(dim=-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    source = raw if raw_logprobs else torch.where(greedy.unsqueeze(-1), raw, processed)
    return tokens, source.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
