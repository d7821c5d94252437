"""Tool calls through the OpenAI front, end to end: the official `openai` client against a real
sidecar started with `--enable-auto-tool-choice --tool-call-parser hermes --chat-template` (the
Hermes ChatML template). The tiny model is taught, by a real push, to answer one question with a
tool call and another with a malformed one, so the answers' tool calls come from its own greedy
tokens: whole and streamed, sent back with their token ids, and the bad inputs agents send."""

import json
import subprocess
import sys

import openai
import pytest

from rollout import RolloutClient
from rollout.tool_calls import HERMES_CHAT_TEMPLATE
from tests.rollout.sidecar import TOKEN, Sidecar, openai_client

pytestmark = pytest.mark.timeout(300)

MODEL = "policy"
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
ASK = [{"role": "user", "content": "what is 17 times 23?"}]
ASK_BADLY = [{"role": "user", "content": "and 19 times 21?"}]
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'
BAD_CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "19*21"</tool_call>'
GREEDY = {"temperature": 0, "max_tokens": 100}


@pytest.fixture(scope="module")
def front(qwen2_dir):
    s = Sidecar(qwen2_dir, "--http-port", "0", "--served-model-name", MODEL, "--max-model-len", "1024",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--chat-template", str(HERMES_CHAT_TEMPLATE))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(front):
    c = openai_client(front)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(qwen2_tokenizer):
    return qwen2_tokenizer


@pytest.fixture(scope="module")
def taught(front, oai, qwen2_dir, tokenizer):
    """The engines serve a policy that answers ASK with CALL_TEXT and ASK_BADLY with BAD_CALL_TEXT
    (then EOS): taught on the prompts the server itself renders, pushed as a trainer pushes."""
    import torch
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    rows = []
    for messages, text in ((ASK, CALL_TEXT), (ASK_BADLY, BAD_CALL_TEXT)):
        prompt = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1).prompt_token_ids
        rows.append((prompt, tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]))
    _overfit(policy, rows)
    zc = RolloutClient(front.url, token=TOKEN)
    try:
        zc.init_weight_sync(take_over=True)
        version = zc.stats()["version"] + 1
        zc.push_weights(policy, version=version)
    finally:
        zc.close()
    return version


def _overfit(policy, rows, max_steps: int = 400) -> None:
    """Trains until every completion token is the greedy choice after its prefix, with a margin."""
    import torch

    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(max_steps):
        loss, settled = 0.0, True
        for prompt, target in rows:
            ids = torch.tensor([prompt + target])
            logits = policy(ids).logits[0, len(prompt) - 1:-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(target))
            top2 = logits.topk(2).values
            settled &= bool((logits.argmax(-1) == torch.tensor(target)).all() and (top2[:, 0] - top2[:, 1]).min() > 2)
        if settled:
            return
        opt.zero_grad()
        loss.backward()
        opt.step()
    raise AssertionError("the tiny model did not learn the tool-call answers")


def _ask(oai, messages, **kw):
    return oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **{**GREEDY, **kw})


def test_a_whole_answer_carries_the_models_tool_call(oai, taught, tokenizer):
    r = _ask(oai, ASK)
    c = r.choices[0]
    assert tokenizer.decode(c.token_ids, skip_special_tokens=True) == CALL_TEXT  # the model's own tokens
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "17*23"}
    assert c.weight_versions == [taught] * len(c.token_ids)  # per-token versions and ids, as every answer


def test_a_streamed_answer_carries_the_same_tool_call(oai, taught):
    whole = _ask(oai, ASK).choices[0]
    ids, versions, calls, content, finish = [], [], {}, "", None
    for chunk in _ask(oai, ASK, stream=True):
        for c in chunk.choices:
            ids += c.token_ids or []
            versions += c.weight_versions or []
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or ():  # accumulated as OpenAI's stream is
                got = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                got["name"] += tc.function.name or ""
                got["arguments"] += tc.function.arguments or ""
    assert ids == whole.token_ids and versions == whole.weight_versions and finish == "tool_calls"
    assert content == "" and list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.message.tool_calls[0].function.name,
                                                         whole.message.tool_calls[0].function.arguments)


def test_the_openai_stream_helper_assembles_the_tool_call(oai, taught):
    """The SDK's own accumulator (client.chat.completions.stream) reads our deltas as OpenAI's."""
    with oai.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, **GREEDY) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "17*23"}


def test_a_tool_turn_sent_back_keeps_its_token_ids_exact(oai, taught, tokenizer):
    r1 = _ask(oai, ASK)
    c1 = r1.choices[0]
    assistant = c1.message.model_dump(exclude_none=True) | {"token_ids": c1.token_ids}
    tool = {"role": "tool", "tool_call_id": c1.message.tool_calls[0].id, "content": "391"}
    r2 = _ask(oai, ASK + [assistant, tool], max_tokens=4)
    n = len(r1.prompt_token_ids) + len(c1.token_ids)
    assert r2.prompt_token_ids[:n] == r1.prompt_token_ids + c1.token_ids  # the turn as sampled, EOS included
    tail = tokenizer.decode(r2.prompt_token_ids[n:])
    assert tail == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    # without token_ids the template renders the call from tool_calls (arguments as an object)
    assistant.pop("token_ids")
    r3 = _ask(oai, ASK + [assistant, tool], max_tokens=4)
    assert tokenizer.decode(r3.prompt_token_ids[len(r1.prompt_token_ids):]).startswith(CALL_TEXT + "<|im_end|>\n")


def test_a_malformed_tool_call_comes_back_as_content(oai, taught, tokenizer):
    c = _ask(oai, ASK_BADLY).choices[0]
    assert tokenizer.decode(c.token_ids, skip_special_tokens=True) == BAD_CALL_TEXT
    assert c.message.content == BAD_CALL_TEXT and not c.message.tool_calls and c.finish_reason == "stop"
    content = "".join(ch.choices[0].delta.content or "" for ch in _ask(oai, ASK_BADLY, stream=True) if ch.choices)
    assert content == BAD_CALL_TEXT


def test_tool_choice_none_answers_text(oai, taught):
    c = _ask(oai, ASK, tool_choice="none").choices[0]
    assert c.message.content == CALL_TEXT and not c.message.tool_calls and c.finish_reason == "stop"


def test_an_unknown_tool_call_id_is_a_400_naming_it(oai, taught):
    c1 = _ask(oai, ASK).choices[0]
    assistant = c1.message.model_dump(exclude_none=True) | {"token_ids": c1.token_ids}
    with pytest.raises(openai.BadRequestError, match="call_not_made") as e:
        _ask(oai, ASK + [assistant, {"role": "tool", "tool_call_id": "call_not_made", "content": "391"}])
    assert e.value.body["param"] == "messages.2.tool_call_id"
    with pytest.raises(openai.BadRequestError, match="call_before"):  # a tool answer before its call
        _ask(oai, ASK + [{"role": "tool", "tool_call_id": "call_before", "content": "1"}, assistant])
    assert _ask(oai, ASK).choices[0].message.tool_calls  # the server goes on


def test_auto_tool_choice_without_the_flags_is_a_400_naming_the_missing_one(qwen2_dir):
    with Sidecar(qwen2_dir, "--http-port", "0", "--served-model-name", MODEL, "--tool-call-parser", "hermes",
                 "--chat-template", str(HERMES_CHAT_TEMPLATE), "--max-model-len", "1024") as s, \
            openai.OpenAI(base_url=s.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120) as c:
        with pytest.raises(openai.BadRequestError,
                           match=r'"auto" tool choice requires --enable-auto-tool-choice to') as e:
            c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=2)
        assert e.value.body["param"] == "tool_choice"
        # no tool_choice: the tools go into the prompt and the answer is text, as before tool parsing
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=2)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("flags,says", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "mistral"], "unknown tool-call parser 'mistral'; known: hermes, qwen3_json"),
    (["--chat-template", "no_such_file.jinja"], "no such file, and not a Jinja template"),
])
def test_bad_tool_flags_end_the_sidecar_before_it_starts(qwen2_dir, flags, says):
    r = subprocess.run([sys.executable, "-m", "rollout.serve", "--model", qwen2_dir, *flags],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and says in r.stderr, r.stderr[-2000:]
