"""Prompt logprobs (`SamplingParams.prompt_logprobs=k`): the prefill's rows of a prompt turned
into vLLM's shape, None for the first token, then per position {token: (logprob, rank)} for the
prompt's own next token and the k most likely, from the model's raw distribution."""

from __future__ import annotations

import torch

from engine.sampler import token_ranks
from engine.sequence import Sequence
from engine.step_sampling import entries

# Prompt positions turned into logprobs at once: bounds the [chunk, V] float32 temporaries (a
# 4k-token prompt at a 152k vocabulary would be ~2.5 GB per [T, V] tensor)
PROMPT_LOGPROBS_CHUNK = 512


def take_prompt_logprobs(seqs: list[Sequence], logits: torch.Tensor, prompt_rows: dict[int, tuple[int, int]],
                         out: dict[int, list]) -> torch.Tensor:
    """For the sequences in `prompt_rows` (seq_id -> (first row, prompt length) in `logits`),
    write their prompt logprobs into `out[seq_id]` and take their rows out of `prompt_rows`;
    return the logits of one row per sequence (each one's last), for sampling."""
    keep = torch.ones(logits.shape[0], dtype=torch.bool)
    for seq in seqs:
        if seq.seq_id not in prompt_rows:
            continue
        first, length = prompt_rows.pop(seq.seq_id)
        keep[first : first + length - 1] = False
        entries_ = []
        for start in range(1, length, PROMPT_LOGPROBS_CHUNK):
            end = min(length, start + PROMPT_LOGPROBS_CHUNK)
            entries_ += _prompt_entries(logits[first + start - 1 : first + end - 1], seq.token_ids[start:end],
                                        seq.params.prompt_logprobs)
        out[seq.seq_id] = [None, *entries_]
    return logits[keep.to(logits.device)]


def _prompt_entries(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, tuple[float, int]]]:
    """Entries of a chunk of prompt positions: the next token's logprob and rank, the top k."""
    rows = torch.log_softmax(logits, dim=-1)
    chosen = rows.gather(-1, torch.tensor(targets, device=rows.device).unsqueeze(-1)).squeeze(-1)
    top = rows.topk(k, dim=-1)
    return entries(targets, chosen.tolist(), token_ranks(rows, chosen).tolist(), top.indices.tolist(),
                   top.values.tolist(), [k] * len(targets))
