"""What a tool-call parser returns: OpenAI's tool calls, built from the model's text."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_tool_call_id() -> str:
    """OpenAI's shape: "call_" and 24 characters."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for; `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def as_openai(self) -> dict:
        """The `message.tool_calls[i]` object of a chat completion."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A response's text split as vLLM's `ExtractedToolCallInformation`: the text for `content`
    (None when the tool calls are all there is) and the calls. When nothing parses as a tool call
    the whole text is content and `tools_called` is False."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)
