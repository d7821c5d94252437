"""Decides whether a sequence is done after it gained a token."""

from __future__ import annotations

from engine.sequence import Sequence


def check_stop(seq: Sequence, eos_ids: frozenset[int], max_model_len: int, tokenizer) -> tuple[str, int | str | None] | None:
    """Returns (finish_reason, stop_reason) if `seq` must stop after its newest token, else None."""
    p, token = seq.params, seq.token_ids[-1]
    if not p.ignore_eos and token in eos_ids:
        return "stop", None
    if token in p.stop_token_ids:
        return "stop", token
    if p.stop:
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        # vLLM's min_tokens: a stop string counts only where it ends after the first min_tokens tokens
        for s in p.stop if seq.num_output_tokens > p.min_tokens else ():
            if text.find(s, seq.stop_check_from) != -1:
                return "stop", s
        # Bytes of a multi-byte character can decode differently once completed: keep a margin.
        seq.stop_check_from = max(0, len(text) - max(len(s) for s in p.stop) - 1)
    if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
        return "length", None
    if len(seq) >= max_model_len:
        return "length", None
    return None


def truncate_at_stop(text: str, stop_reason: int | str | None, include_stop_str: bool) -> str:
    """The output text ends before the stop string that ended it (after it, if asked to keep it)."""
    if not isinstance(stop_reason, str):
        return text
    i = text.find(stop_reason)
    if i == -1:
        return text
    return text[: i + len(stop_reason)] if include_stop_str else text[:i]


def first_stop_string(token_ids: list[int], stops: list[str], tokenizer, first_new: int) -> tuple[int, str] | None:
    """For a completion whose tokens before `first_new` hold no stop string: (k, s) for the
    shortest prefix `token_ids[:k]` whose text holds a stop string `s`, or None. For a completion
    generated in pieces, where a stop string may straddle two (each piece's engine sees only
    its own text).

    Only a window of tokens before the k-th is decoded: a stop string of c characters ending in
    token k starts at most 4c tokens earlier (a character is at most 4 byte-level tokens); the
    margin keeps a character cut at the window's start away from the string."""
    if not stops:
        return None
    width = 4 * max(len(s) for s in stops) + 8
    for k in range(first_new + 1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[max(0, k - width):k], skip_special_tokens=True)
        for s in stops:
            if s in text:
                return k, s
    return None
