"""vLLM's logits processors, as pure functions: allowed_token_ids, bad_words, min_tokens and
logit_bias.

They act on the model's float32 logits in vLLM's order (allowed tokens, bans, bias), before
penalties, temperature and truncation, so a greedy row's argmax and every processed logprob see
them. `sequence_bans` decides, on the host, which tokens each row may not take at this step;
the device work is one masked fill and two index writes over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitsEdits:
    """One step's edits, on the logits' device; None where no row has one."""

    allowed: torch.Tensor | None = None  # [B, V] bool: True where the row may sample (rows without a list: all)
    bans: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, values) added


def apply_edits(logits: torch.Tensor, e: LogitsEdits | None) -> torch.Tensor:
    """The edited logits [B, V] (a new tensor when anything changes; `logits` is not written)."""
    if e is None:
        return logits
    logits = logits.clone()  # one copy, then every edit in place
    if e.allowed is not None:
        logits.masked_fill_(~e.allowed, float("-inf"))
    if e.bans is not None:
        logits.index_put_(e.bans, torch.tensor(float("-inf"), device=logits.device))
    if e.bias is not None:
        rows, cols, values = e.bias
        logits.index_put_((rows, cols), values.to(logits.dtype), accumulate=True)
    return logits


def bad_word_bans(output_ids: list[int], bad_words: list[list[int]]) -> list[int]:
    """The tokens that would complete a bad word now: each word's last token when the output
    ends with the rest of it (a one-token word is always banned). vLLM's rule: only the
    generated tokens count, not the prompt."""
    bans = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output_ids):
            continue
        if prefix == 0 or output_ids[-prefix:] == word[:-1]:
            bans.append(word[-1])
    return bans


def sequence_bans(num_output_tokens: int, min_tokens: int, stop_ids: tuple[int, ...], output_ids: list[int],
                  bad_words: list[list[int]]) -> list[int]:
    """Tokens one sequence may not sample at this step: its stop tokens (EOS unless ignore_eos,
    and stop_token_ids) while it has fewer than min_tokens, and the ends of its bad words."""
    bans = list(stop_ids) if num_output_tokens < min_tokens else []
    if bad_words:
        bans += bad_word_bans(output_ids, bad_words)
    return bans


def build_edits(rows: list, vocab: int, device) -> LogitsEdits | None:
    """The edits of a batch, from per row (allowed ids or None, banned ids, {id: bias} or None).
    None when no row has any (the common case costs nothing on the device)."""
    e = LogitsEdits()
    if any(ids is not None for ids, _, _ in rows):
        e.allowed = _allowed_mask([ids for ids, _, _ in rows], vocab, device)
    bans = [(i, t) for i, (_, banned, _) in enumerate(rows) for t in banned]
    if bans:
        e.bans = tuple(torch.tensor(col, dtype=torch.long, device=device) for col in zip(*bans))
    bias = [(i, t, v) for i, (_, _, b) in enumerate(rows) for t, v in (b or {}).items()]
    if bias:
        r, c, v = zip(*bias)
        e.bias = (torch.tensor(r, dtype=torch.long, device=device), torch.tensor(c, dtype=torch.long, device=device),
                  torch.tensor(v, dtype=torch.float32, device=device))
    return e if (e.allowed is not None or e.bans is not None or e.bias is not None) else None


def _allowed_mask(lists: list[list[int] | None], vocab: int, device) -> torch.Tensor:
    """[B, V] True where a row may sample. The n rows of a request share one list: one write per
    distinct list, not per row (a per-row loop over thousands of ids took seconds a step)."""
    mask = torch.ones(len(lists), vocab, dtype=torch.bool, device=device)
    rows_of: dict[int, list[int]] = {}
    for i, ids in enumerate(lists):
        if ids is not None:
            rows_of.setdefault(id(ids), []).append(i)
    for rows in rows_of.values():
        r = torch.tensor(rows, device=device)
        mask[r] = False
        mask[r.unsqueeze(-1), torch.tensor(lists[rows[0]], device=device).unsqueeze(0)] = True
    return mask
