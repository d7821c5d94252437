"""Text of a sample as its tokens stream in: each call returns only the new text, holding back
what may still change (an unfinished UTF-8 character, the start of a stop string), so the deltas
joined are the final text exactly."""

from __future__ import annotations

from engine.stop_checker import truncate_at_stop


class IncrementalText:
    def __init__(self, tokenizer, stop: list[str], include_stop_str: bool):
        self.tokenizer, self.stop, self.include_stop_str = tokenizer, stop, include_stop_str
        self.hold = max((len(s) for s in stop), default=1) - 1  # a stop string may be forming at the end
        self.token_ids: list[int] = []
        self.sent = ""

    def add(self, token_ids: list[int], finished: bool = False, stop_reason=None) -> str:
        self.token_ids += token_ids
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if finished:
            text = truncate_at_stop(text, stop_reason, self.include_stop_str)
        else:
            if text.endswith("\ufffd"):  # a character whose bytes are not all here yet
                text = text.rstrip("\ufffd")
            if self.hold:
                text = text[:max(len(self.sent), len(text) - self.hold)]
        if not text.startswith(self.sent):  # a decode that changed its mind about sent text: send nothing new
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
