"""Our Hermes parser and vLLM's own (`Hermes2ProToolParser`, from the installed vllm) on the same
texts give the same names, arguments and content. Skipped where vllm cannot be imported."""

import pytest

from rollout.tool_calls import get_tool_parser
from tests.rollout import tool_call_texts as texts

pytestmark = pytest.mark.timeout(120)

# Where we depart from vLLM 0.32 on purpose (hermes.py says why): a string holding a JSON object is
# that object (newer vLLM's rule), and NaN is no JSON. Every other text must match.
DEPARTURES = {texts.SERIALIZED_ARGS, texts.string_args_text('{"param": "max_connections"}')}
SAME = [t for t in [*texts.WELL_FORMED, *texts.MALFORMED, *texts.NO_CALL, texts.SERIALIZED_ARGS,
                    *map(texts.string_args_text, texts.STRING_ARGS)] if t not in DEPARTURES]


@pytest.fixture(scope="module")
def vllm_parser():
    try:
        from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    except Exception as e:  # noqa: BLE001 - any import failure means: no vllm here
        pytest.skip(f"vllm cannot be imported: {e}")

    class Tokenizer:  # the parser keeps it, and reads nothing from it for these calls
        pass

    return Hermes2ProToolParser(Tokenizer())


@pytest.mark.parametrize("text", SAME)
def test_our_extraction_equals_vllms(vllm_parser, text):
    theirs = vllm_parser.extract_tool_calls(text, request=None)
    ours = get_tool_parser("hermes").extract(text)
    assert ours.tools_called == theirs.tools_called
    assert ours.content == theirs.content
    assert [(c.name, c.arguments) for c in ours.tool_calls] == [
        (c.function.name, c.function.arguments) for c in theirs.tool_calls]


def test_vllm_0_32_encodes_serialized_arguments_twice_and_we_do_not(vllm_parser):
    """The one departure, pinned: vLLM 0.32 encodes the string again, later vLLM unwraps it as we do."""
    theirs = vllm_parser.extract_tool_calls(texts.SERIALIZED_ARGS, request=None).tool_calls[0].function.arguments
    ours = get_tool_parser("hermes").extract(texts.SERIALIZED_ARGS).tool_calls[0].arguments
    assert ours == '{"param": "max_connections"}'
    assert theirs in (ours, '"{\\"param\\": \\"max_connections\\"}"')
