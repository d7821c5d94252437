"""Model outputs in the Hermes tool-call format, for the parser's tests: most from vLLM's
tests/tool_parsers/test_hermes_tool_parser.py, a few of ours (malformed calls, partial tags)."""

import json

WEATHER = ('<tool_call>\n{"name": "get_current_temperature",\n"arguments": {"location":\n'
           '"San Francisco, California, United States", "unit": "celsius"}}\n</tool_call>')
TRIGGER = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'
CONTENT_THEN_CALL = ('Sure, let me check the weather.<tool_call>{"name": "get_weather", "arguments": {"city": "NYC"}}'
                     "</tool_call>")
TWO_CALLS = ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
             '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>')
UNTIL_EOS = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}'
SERIALIZED_ARGS = ('<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n'
                   "</tool_call>")
BARE_STRING_ARGS = '<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>'
PLAIN = "This is some prior text that has nothing to do with tool calling."
UNICODE = ('Je vais chercher. <tool_call>{"name": "météo", "arguments": {"ville": "Zürich", "emoji": "☀️"}}'
           "</tool_call>")

WELL_FORMED = {  # text -> (content, [(name, arguments as JSON values)])
    WEATHER: (None, [("get_current_temperature",
                      {"location": "San Francisco, California, United States", "unit": "celsius"})]),
    TRIGGER: (None, [("final_answer", {"trigger": True})]),
    CONTENT_THEN_CALL: ("Sure, let me check the weather.", [("get_weather", {"city": "NYC"})]),
    TWO_CALLS: (None, [("search", {"q": "cats"}), ("search", {"q": "dogs"})]),
    UNTIL_EOS: (None, [("final_answer", {"trigger": True})]),
    BARE_STRING_ARGS: (None, [("do_thing", "hello")]),
    UNICODE: ("Je vais chercher. ", [("météo", {"ville": "Zürich", "emoji": "☀️"})]),
    'Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>': ("Hi!", [("f", {"x": 1})]),
    '<tool_call>{"name": "f", "arguments": {}}</tool_call> trailing text is dropped, as vLLM does':
        (None, [("f", {})]),
}

MALFORMED = [  # each comes back whole as content, no tool call
    '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}',  # vLLM's invalid-JSON case
    "<tool_call>not json at all</tool_call>",
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',  # a name that is not a string
    '<tool_call>["f", {"a": 1}]</tool_call>',  # not an object
    "<tool_call></tool_call>",
    "<tool_call>",
    'ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", "arguments": </tool_call>',
]

NO_CALL = [PLAIN, "", "a < b and <tool is not a tag", "ends with a partial tag <tool_ca", "</tool_call> alone"]

STRING_ARGS = ['{"param": "max_connections"}', "hello", "{hello world}", "[oops", '{"a": 1} tail text']


def string_args_text(value: str) -> str:
    return "<tool_call>" + json.dumps({"name": "f", "arguments": value}) + "</tool_call>"
