"""Tool calls read out of a model's text, as vLLM's `--tool-call-parser` reads them.

    parser = get_tool_parser("hermes")
    got = parser.extract('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    got.tools_called, got.content, got.tool_calls[0].name, got.tool_calls[0].arguments
    # True, None, "add", '{"a": 1}'
    s = parser.stream(); deltas = s.feed("Sure. <tool"); deltas += s.finish()   # OpenAI delta dicts

A malformed call comes back as content, never as an exception.
"""

from __future__ import annotations

from pathlib import Path

from rollout.tool_calls.hermes import HermesToolParser
from rollout.tool_calls.types import ExtractedToolCalls, ToolCall, new_tool_call_id

# a ChatML template that takes tools in the Hermes format, for models whose own takes none
HERMES_CHAT_TEMPLATE = Path(__file__).with_name("hermes_chatml.jinja")

# vLLM's names (vllm/tool_parsers/__init__.py); qwen3_json is vLLM's alias of hermes too
PARSERS = {"hermes": HermesToolParser, "qwen3_json": HermesToolParser}


def get_tool_parser(name: str) -> HermesToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


def flags_problem(parser: str | None, auto: bool) -> str | None:
    """What is wrong with `--tool-call-parser` and `--enable-auto-tool-choice` together (vLLM refuses
    the same at start-up), or None."""
    if auto and not parser:
        return "--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)"
    if parser and parser not in PARSERS:
        return f"--tool-call-parser: unknown tool-call parser {parser!r}; known: {', '.join(sorted(PARSERS))}"
    return None


__all__ = ["HERMES_CHAT_TEMPLATE", "PARSERS", "ExtractedToolCalls", "ToolCall", "flags_problem", "get_tool_parser",
           "new_tool_call_id"]
