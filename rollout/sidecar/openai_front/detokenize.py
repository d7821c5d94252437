"""Text of a sample as its tokens stream in: each call returns only the new text, holding back
what may still change (an unfinished UTF-8 character, the start of a stop string), so the deltas
joined are the final text exactly.

Each step decodes only a window, as vLLM's incremental detokenizer does: the text the tokens from
`prefix` to `read` gave, and what the tokens from `prefix` on give now; the difference is new.
Both decodes start at the same token, so a tokenizer that drops a leading space at a window's
start drops it from both. The final text is one decode of every token, the same as a whole
response's."""

from __future__ import annotations

from engine.stop_checker import truncate_at_stop


def fast_decode(tokenizer):
    """tokenizer.decode(ids, skip_special_tokens=True), through the Rust backend when that is what
    it amounts to (half the time: no argument conversion in Python)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalText:
    def __init__(self, tokenizer, stop: list[str], include_stop_str: bool):
        self.decode = fast_decode(tokenizer)
        self.stop, self.include_stop_str = stop, include_stop_str
        self.hold = max((len(s) for s in stop), default=1) - 1  # a stop string may be forming at the end
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (window by window)
        self.prefix = self.read = 0
        self.sent = ""

    def add(self, token_ids: list[int], finished: bool = False, stop_reason=None) -> str:
        self.token_ids += token_ids
        if finished:
            text = truncate_at_stop(self.decode(self.token_ids), stop_reason, self.include_stop_str)
        else:
            before = self.decode(self.token_ids[self.prefix:self.read])
            now = self.decode(self.token_ids[self.prefix:])
            if len(now) > len(before) and not now.endswith("\ufffd"):  # else a character is still incomplete
                self.text += now[len(before):]
                self.prefix, self.read = self.read, len(self.token_ids)
            text = self.text[:max(len(self.sent), len(self.text) - self.hold)] if self.hold else self.text
        if not text.startswith(self.sent):  # a decode that changed its mind about sent text: send nothing new
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
