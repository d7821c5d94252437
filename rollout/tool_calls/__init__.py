"""Tool calls read out of a model's text, as vLLM's `--tool-call-parser` reads them.

    parser = get_tool_parser("hermes")
    got = parser.extract('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    got.tools_called, got.content, got.tool_calls[0].name, got.tool_calls[0].arguments
    # True, None, "add", '{"a": 1}'
    s = parser.stream(); deltas = s.feed("Sure. <tool"); deltas += s.finish()   # OpenAI delta dicts

A malformed call comes back as content, never as an exception.
"""

from __future__ import annotations

from rollout.tool_calls.hermes import HermesToolParser
from rollout.tool_calls.types import ExtractedToolCalls, ToolCall, new_tool_call_id

# vLLM's names (vllm/tool_parsers/__init__.py); qwen3_json is vLLM's alias of hermes too
PARSERS = {"hermes": HermesToolParser, "qwen3_json": HermesToolParser}


def get_tool_parser(name: str) -> HermesToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


__all__ = ["PARSERS", "ExtractedToolCalls", "ToolCall", "get_tool_parser", "new_tool_call_id"]
