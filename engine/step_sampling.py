"""A step's sampling, the host side: every row's sampling parameters packed into device tensors
(`sampling_tensors`: one host array, one copy; the logits edits and penalties only where a row asks
for them), and the sampled rows' logprobs back in vLLM's shapes (`entries`). The maths on the
device is engine/sampler.py's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine import step_inputs
from engine.logits_processors import build_edits, sequence_bans
from engine.sampler import Penalties, SamplingTensors, TopLogprobs, counter_uniforms, uniform_noise
from engine.sequence import Sequence


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, tuple[float, int]]] | None = None  # per row {id: (logprob, rank)}: see entries


def entries(tokens: list[int], values: list[float], ranks: list[int], top_ids: list[list[int]],
            top_values: list[list[float]], ks: list[int]) -> list[dict[int, tuple[float, int]]]:
    """Per position {token id: (logprob, rank)}: the sampled (or prompt) token first, then its k
    most likely (vLLM's shape; a token among the top k takes its place's rank)."""
    out = []
    for tok, lp, rank, ids, vals, k in zip(tokens, values, ranks, top_ids, top_values, ks):
        entry = {tok: (lp, rank)}
        entry.update((i, (v, j + 1)) for j, (i, v) in enumerate(zip(ids[:k], vals[:k])))
        out.append(entry)
    return out



def top_entries(seqs: list[Sequence], tokens: list[int], logprobs: list[float], top: TopLogprobs):
    """Each row's own k of the batch's widest K (None for a row that asked for none)."""
    ks = [s.params.logprobs or 0 for s in seqs]
    rows = entries(tokens, logprobs, top.sampled_ranks.tolist(), top.ids.tolist(), top.values.tolist(), ks)
    return [row if s.params.logprobs is not None else None for s, row in zip(seqs, rows)]


def sampling_tensors(seqs: list[Sequence], vocab: int, device: torch.device, shared_generator: torch.Generator,
                     raw_logprobs: bool = False) -> SamplingTensors:
    """The rows' sampling parameters, packed into one host array and sent in one copy."""
    params = [s.params for s in seqs]
    cols = SamplingColumns(seqs, device)
    t = SamplingTensors(cols["temperature"].float(), raw_logprobs=raw_logprobs)
    t.any_greedy = any(p.greedy for p in params)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    t.num_top_logprobs = max(asked) if asked else None
    t.edits = logits_edits(seqs, vocab, device)
    if cols.any_top_k:
        t.top_k = cols["top_k"].long()
    if cols.any_top_p:
        t.top_p = cols["top_p"].float()
    if cols.any_min_p:
        t.min_p = cols["min_p"].float()
    if any(p.penalised for p in params):
        t.penalties = penalties(seqs, vocab, cols, device)
    if t.num_top_logprobs is not None:
        t.asks_top = torch.tensor([p.logprobs is not None for p in params], device=device)
    plain = [plain_row(s) for s in seqs]
    if any(plain) and not all(plain):  # all plain: the native sampler takes the whole step anyway
        t.plain = torch.tensor(plain)
    if not all(p.greedy for p in params):
        t.uniforms = uniform_noise(shared_generator, len(seqs), device)
        if cols.any_seed:  # a seeded row's draw, made on the host: a function of its seed and position alone
            t.uniforms = torch.where(cols["seeded"] > 0, cols["seeded_uniform"], t.uniforms)
    return t


def plain_row(s: Sequence) -> bool:
    """Whether the row is sampled at its temperature alone (no processor, penalty, filter, top
    logprobs; not greedy): a property of the row itself, so that its sampling rule never depends on
    its neighbours (engine/sampler.py runs such rows natively in any step)."""
    p = s.params
    return (not p.greedy and p.logprobs is None and not p.penalised and p.top_k == 0 and p.top_p == 1
            and p.min_p == 0 and p.allowed_token_ids is None and not p.logit_bias and not s.min_tokens_bans
            and not s.bad_words)


def logits_edits(seqs: list[Sequence], vocab: int, device: torch.device):
    """allowed_token_ids, bans (bad words, min_tokens) and logit_bias of this step's rows."""
    rows = []
    for s in seqs:
        p = s.params
        if p.allowed_token_ids is None and not p.logit_bias and not s.min_tokens_bans and not s.bad_words:
            rows.append((None, (), None))
            continue
        bans = sequence_bans(s.num_output_tokens, p.min_tokens, s.min_tokens_bans, s.output_token_ids, s.bad_words)
        rows.append((p.allowed_token_ids, bans, p.logit_bias))
    return build_edits(rows, vocab, device)


def penalties(seqs: list[Sequence], vocab: int, cols: SamplingColumns, device: torch.device) -> Penalties:
    """Each row's output-token counts and prompt-token mask, built on the device from the
    token ids (only in steps where some row has a penalty): every penalised row's (row,
    token) pairs go in one copy, and two scatters build both, whatever the batch."""
    dev, rows = device, len(seqs)
    out_pairs, prompt_pairs = [], []
    for i, s in enumerate(seqs):
        if s.params.penalised:
            out_pairs.append(np.stack([np.full(s.num_output_tokens, i), s.output_token_ids]))
            prompt_pairs.append(np.stack([np.full(s.num_prompt_tokens, i), s.token_ids[: s.num_prompt_tokens]]))
    n_out = sum(p.shape[1] for p in out_pairs)
    pairs = step_inputs.upload(np.concatenate(out_pairs + prompt_pairs, axis=1).astype(np.int64), dev)
    counts = torch.zeros(rows, vocab, device=dev)
    counts.index_put_((pairs[0, :n_out], pairs[1, :n_out]), torch.ones(n_out, device=dev), accumulate=True)
    prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=dev)
    prompt[pairs[0, n_out:], pairs[1, n_out:]] = True
    return Penalties(cols["repetition_penalty"].float(), cols["presence_penalty"].float(),
                     cols["frequency_penalty"].float(), counts, prompt)


class SamplingColumns:
    """Every row's sampling parameters in one float64 host array, sent to the device in one
    copy; `cols[name]` is that column on the device. A seeded row's uniform is drawn here, on
    the host (sampler.counter_uniforms of its stream's key and position), and travels along."""

    NAMES = ("temperature", "top_k", "top_p", "min_p", "seeded", "seeded_uniform",
             "repetition_penalty", "presence_penalty", "frequency_penalty")

    def __init__(self, seqs: list[Sequence], device: torch.device):
        host = np.empty((len(self.NAMES), len(seqs)), dtype=np.float64)
        keys, positions = np.empty(len(seqs), dtype=np.int64), np.empty(len(seqs), dtype=np.int64)
        self.any_top_k = self.any_top_p = self.any_min_p = self.any_seed = False
        for i, s in enumerate(seqs):
            p = s.params
            key = s.seed_key
            keys[i], positions[i] = key or 0, s.num_output_tokens
            host[:, i] = (p.temperature, p.top_k, p.top_p, p.min_p, key is not None, 0.0,
                          p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
            self.any_top_k |= bool(p.top_k)
            self.any_top_p |= p.top_p < 1
            self.any_min_p |= p.min_p > 0
            self.any_seed |= key is not None
        if self.any_seed:  # every row's counter draw at once (unseeded rows' go unused)
            host[self.NAMES.index("seeded_uniform")] = counter_uniforms(keys, positions)
        self._device = step_inputs.upload(host, device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._device[self.NAMES.index(name)]
