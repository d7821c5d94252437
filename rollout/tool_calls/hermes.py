"""The Hermes tool-call format (Hermes 2 Pro, Qwen2.5 / Qwen3, and most ChatML templates that take
tools): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the text.

Parsed as vLLM's `Hermes2ProToolParser` parses a whole response (vllm/tool_parsers/
hermes_tool_parser.py): the calls are every `<tool_call>` region (the last may lack its closing tag),
the content is the text before the first one (None when empty), and if any region is not a call
(bad JSON, no name, no arguments) nothing is: the whole text comes back as content. One departure:
arguments holding NaN or Infinity (which JSON cannot carry) make the call malformed, where vLLM
would send invalid JSON text. Arguments written as a string holding a JSON object are that object
(newer vLLM's rule; vLLM 0.32 encodes the string twice).

Streaming sends the content before the first `<tool_call>` as it grows (holding back a tail that
may be the tag's start), and the calls when the response ends, from the same whole-response parse:
the streamed answer is the whole answer by construction, and a malformed call is never half sent.
A turn's tool calls end it, so holding them to the end delays nothing an agent could act on.
"""

from __future__ import annotations

import json
import logging
import re

from rollout.tool_calls.types import ExtractedToolCalls, ToolCall

log = logging.getLogger(__name__)

START, END = "<tool_call>", "</tool_call>"
_REGION = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _call(body: str) -> ToolCall:
    """One region's JSON -> a call; ValueError (or TypeError/KeyError) when it is not one."""
    obj = json.loads(body)
    name = obj["name"]
    if not isinstance(name, str):
        raise TypeError(f"the tool call's name is {type(name).__name__}, not a string")
    return ToolCall(name=name, arguments=json.dumps(_unwrapped(obj["arguments"]), ensure_ascii=False, allow_nan=False))


def _unwrapped(arguments):
    """Arguments the model wrote as a JSON string holding an object (Granite 4 does) are that object,
    not a string encoded twice (vLLM's rule since its bug fix; only an object is unwrapped)."""
    if isinstance(arguments, str):
        try:
            inner = json.loads(arguments)
        except ValueError:
            return arguments
        if isinstance(inner, dict):
            return inner
    return arguments


def held_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (vLLM's partial_tag_overlap)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesToolParser:
    """Stateless: one per server; `stream()` gives the per-response state."""

    name = "hermes"
    start_tag = START

    def extract(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(content=text)
        try:
            calls = [_call(whole or open_ended) for whole, open_ended in _REGION.findall(text)]
        except (ValueError, TypeError, KeyError) as e:  # the model's own text: never an error of ours
            log.debug("a malformed tool call is sent as content: %s", e)
            return ExtractedToolCalls(content=text)
        content = text[:text.index(START)]
        return ExtractedToolCalls(content=content or None, tool_calls=calls)

    def stream(self) -> HermesStream:
        return HermesStream(self)


class HermesStream:
    """One streamed response: `feed(delta_text)` and, once, `finish()` each return the OpenAI
    `delta` objects to send (`{"content": ...}`, `{"tool_calls": [...]}`), maybe none. After
    `finish()`, `extracted` is the whole response's parse."""

    def __init__(self, parser: HermesToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # how much of `text` went out as content
        self.extracted: ExtractedToolCalls | None = None

    @property
    def tools_called(self) -> bool:
        return self.extracted is not None and self.extracted.tools_called

    def feed(self, delta_text: str) -> list[dict]:
        self.text += delta_text
        at = self.text.find(START, self.sent)
        upto = at if at >= 0 else len(self.text) - held_tail(self.text, START)
        if upto <= self.sent:  # nothing new, or past the first tag: the rest waits for finish()
            return []
        piece, self.sent = self.text[self.sent:upto], upto
        return [{"content": piece}]

    def finish(self) -> list[dict]:
        self.extracted = self.parser.extract(self.text)
        if not self.extracted.tools_called:  # plain text, or a malformed call: the rest is content
            rest, self.sent = self.text[self.sent:], len(self.text)
            return [{"content": rest}] if rest else []
        return [{"tool_calls": [{"index": i, **c.as_openai()} for i, c in enumerate(self.extracted.tool_calls)]}]
