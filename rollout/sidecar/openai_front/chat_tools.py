"""Tool calls on /v1/chat/completions, as vLLM serves them (`--tool-call-parser`,
`--enable-auto-tool-choice`): which requests are parsed, the tool messages' ids, and the answer's
message, finish reason and stream deltas.

A request is parsed when it has `tools` and `tool_choice` "auto" (or no tool_choice, vLLM's
default with tools) on a server started with both flags. An explicit "auto" without them is a 400
naming the missing flag, as vLLM's; `tool_choice: "none"`, or tools without a tool_choice on a
server without the flags, put the tools in the prompt and answer text (the latter as this server
did before it parsed tool calls, where vLLM would refuse)."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.sidecar.openai_front.schema import BadField, ChatCompletionRequest
from rollout.tool_calls import ExtractedToolCalls, get_tool_parser


@dataclass(frozen=True)
class ToolOptions:
    """The server's flags: `--tool-call-parser NAME` and `--enable-auto-tool-choice` (checked together
    at start-up: rollout.tool_calls.flags_problem)."""

    parser: str | None = None
    auto: bool = False

    def parser_for(self, req: ChatCompletionRequest):
        """The parser this request's answer goes through, or None (answer as text); BadField (a
        400) for tool_choice "auto" on a server without the flags."""
        if not req.tools or req.tool_choice == "none":
            return None
        missing = [flag for flag, on in (("--enable-auto-tool-choice", self.auto),
                                         ("--tool-call-parser", bool(self.parser))) if not on]
        if not missing:
            return get_tool_parser(self.parser)
        if req.tool_choice == "auto":
            raise BadField("tool_choice", f'"auto" tool choice requires {" and ".join(missing)} to be set on this '
                                          "server (rollout.serve --enable-auto-tool-choice --tool-call-parser hermes)")
        return None


def check_tool_call_ids(messages) -> None:
    """Each tool message's `tool_call_id` names a tool call of an earlier assistant message (a 400
    naming it otherwise). A tool message without one is passed to the template as it is."""
    called: set[str] = set()
    for j, m in enumerate(messages):
        if m.role == "assistant":
            called.update(c.id for c in m.tool_calls or ())
        elif m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in called:
            raise BadField(f"messages.{j}.tool_call_id",
                           f"messages[{j}]: tool_call_id {m.tool_call_id!r} matches no tool call of an earlier "
                           f"assistant message (known: {sorted(called)})")


def message(got: ExtractedToolCalls | None, text: str) -> dict:
    """The choice's `message`: with a parser, `content` and `tool_calls` as vLLM's."""
    if got is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": got.content, "tool_calls": [c.as_openai() for c in got.tool_calls]}


def finish_reason(got: ExtractedToolCalls | None, engine_reason: str | None) -> str | None:
    """"tool_calls" when the answer called a tool, whatever ended it (vLLM's rule)."""
    return "tool_calls" if got is not None and got.tools_called else engine_reason


def merged(deltas: list[dict]) -> dict:
    """A stream parser's deltas for one engine step as one OpenAI `delta` object."""
    out: dict = {}
    for d in deltas:
        if "content" in d:
            out["content"] = out.get("content", "") + d["content"]
        if "tool_calls" in d:
            out["tool_calls"] = out.get("tool_calls", []) + d["tool_calls"]
    return out
