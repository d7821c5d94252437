"""rollout.tool_calls against vLLM's Hermes tool-parser tests (tests/tool_parsers/
test_hermes_tool_parser.py, the ones that need no model): whole responses, and streams cut at
every chunk size, accumulated as the openai client accumulates deltas. A malformed call is
content, never an exception, and a stream always adds up to the whole response's parse."""

import json

import pytest

from rollout.tool_calls import ExtractedToolCalls, get_tool_parser
from tests.rollout import tool_call_texts as texts

INTERVALS = [1, 2, 3, 5, 8, 9999]


@pytest.fixture
def parser():
    return get_tool_parser("hermes")


def streamed(parser, text: str, interval: int) -> tuple[str, list[dict], list[dict]]:
    """(content, tool calls as OpenAI objects, every delta) of `text` fed `interval` characters at a time."""
    s, deltas = parser.stream(), []
    for i in range(0, len(text), interval):
        deltas += s.feed(text[i:i + interval])
    deltas += s.finish()
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):  # merged as the openai client merges them
            c = calls.setdefault(tc["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
            c["id"] = tc.get("id") or c["id"]
            c["type"] = tc.get("type") or c["type"]
            for k in ("name", "arguments"):
                c["function"][k] += tc.get("function", {}).get(k) or ""
    return "".join(d.get("content") or "" for d in deltas), [calls[i] for i in sorted(calls)], deltas


def named(got: ExtractedToolCalls) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in got.tool_calls]


# ---- ported from vLLM ----

@pytest.mark.parametrize("interval", INTERVALS)
def test_streaming_plain_text_is_forwarded_whole(parser, interval):
    content, calls, deltas = streamed(parser, texts.PLAIN, interval)
    assert content == texts.PLAIN and not calls
    assert all(set(d) == {"content"} for d in deltas)


@pytest.mark.parametrize("interval", INTERVALS)
def test_streaming_boolean_arguments_bug_19056(parser, interval):
    _, calls, _ = streamed(parser, texts.TRIGGER, interval)
    assert calls[0]["function"]["name"] == "final_answer"
    assert calls[0]["function"]["arguments"] == '{"trigger": true}'


@pytest.mark.parametrize("interval", INTERVALS)
def test_streaming_a_call_over_several_lines(parser, interval):
    _, calls, _ = streamed(parser, texts.WEATHER, interval)
    assert calls[0]["function"]["name"] == "get_current_temperature"
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "location": "San Francisco, California, United States", "unit": "celsius"}


@pytest.mark.parametrize("interval", INTERVALS)
def test_streaming_content_then_a_call(parser, interval):
    content, calls, _ = streamed(parser, texts.CONTENT_THEN_CALL, interval)
    assert content == "Sure, let me check the weather."
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "NYC"}


@pytest.mark.parametrize("interval", INTERVALS)
def test_streaming_two_calls_keep_their_indexes(parser, interval):
    _, calls, _ = streamed(parser, texts.TWO_CALLS, interval)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("search", {"q": "cats"}), ("search", {"q": "dogs"})]
    assert calls[0]["id"] != calls[1]["id"]


def test_whole_response_without_a_call(parser):
    got = parser.extract("This is not a tool call.")
    assert not got.tools_called and got.content == "This is not a tool call." and got.tool_calls == []


def test_whole_response_call_between_tags(parser):
    got = parser.extract(texts.TRIGGER)
    assert got.tools_called and got.content is None
    assert got.tool_calls[0].name == "final_answer" and got.tool_calls[0].arguments == '{"trigger": true}'


def test_whole_response_call_until_eos(parser):
    got = parser.extract(texts.UNTIL_EOS)
    assert got.tools_called and got.tool_calls[0].arguments == '{"trigger": true}'


def test_whole_response_invalid_json_is_content(parser):
    text = texts.MALFORMED[0]
    got = parser.extract(text)
    assert not got.tools_called and got.content == text


def test_serialized_arguments_are_not_encoded_twice(parser):
    got = parser.extract(texts.SERIALIZED_ARGS)
    assert got.tool_calls[0].name == "get_db_config"
    assert json.loads(got.tool_calls[0].arguments) == {"param": "max_connections"}


def test_bare_string_arguments_stay_a_json_string(parser):
    assert json.loads(parser.extract(texts.BARE_STRING_ARGS).tool_calls[0].arguments) == "hello"


@pytest.mark.parametrize("value", texts.STRING_ARGS)
@pytest.mark.parametrize("interval", [1, 3])
def test_string_arguments_stream_as_the_whole_response_parses_them(parser, value, interval):
    text = texts.string_args_text(value)
    _, calls, _ = streamed(parser, text, interval)
    assert calls[0]["function"]["arguments"] == parser.extract(text).tool_calls[0].arguments
    json.loads(calls[0]["function"]["arguments"])  # valid JSON whatever the model wrote


def test_content_and_a_call_in_one_chunk(parser):
    content, calls, _ = streamed(parser, 'Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', 9999)
    assert content == "Hi!" and calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


# ---- ours: every text, both paths ----

@pytest.mark.parametrize("text", list(texts.WELL_FORMED))
def test_well_formed_calls_are_extracted(parser, text):
    content, calls = texts.WELL_FORMED[text]
    got = parser.extract(text)
    assert got.tools_called and got.content == content and named(got) == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got.tool_calls)
    assert [c.as_openai()["type"] for c in got.tool_calls] == ["function"] * len(calls)


@pytest.mark.parametrize("text", texts.MALFORMED + texts.NO_CALL)
@pytest.mark.parametrize("interval", [1, 4, 9999])
def test_malformed_calls_come_back_as_content_in_both_paths(parser, text, interval):
    got = parser.extract(text)
    assert not got.tools_called and got.content == text
    content, calls, _ = streamed(parser, text, interval)
    assert content == text and calls == []


@pytest.mark.parametrize("text", list(texts.WELL_FORMED) + texts.MALFORMED + texts.NO_CALL)
@pytest.mark.parametrize("interval", INTERVALS)
def test_a_stream_adds_up_to_the_whole_response(parser, text, interval):
    whole = parser.extract(text)
    s = parser.stream()
    content, calls, _ = streamed(parser, text, interval)
    assert content == (whole.content or "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole.tool_calls]
    s.feed(text)
    s.finish()
    assert s.tools_called == whole.tools_called


def test_a_partial_tag_is_held_back_until_it_is_decided(parser):
    s = parser.stream()
    assert s.feed("Let me see <tool") == [{"content": "Let me see "}]
    assert s.feed("box> done") == [{"content": "<toolbox> done"}]  # not the tag after all
    assert s.feed(" <tool_call>{") == [{"content": " "}]
    assert s.feed('"name": "f", "arguments": {}}</tool_call>') == []  # calls wait for the end
    assert s.finish() == [{"tool_calls": [{"index": 0, "id": s.extracted.tool_calls[0].id, "type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}]}]


def test_non_finite_arguments_are_malformed(parser):
    text = '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
    assert parser.extract(text) == ExtractedToolCalls(content=text)


def test_an_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; known: hermes, qwen3_json"):
        get_tool_parser("nope")
    assert type(get_tool_parser("qwen3_json")) is type(get_tool_parser("hermes"))
