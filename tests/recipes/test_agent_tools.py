"""The calculator's episodes against a real sidecar (tiny Qwen2, fp32) served as `recipes.agent --env
calculator` serves it (`--enable-auto-tool-choice --tool-call-parser hermes --chat-template` the Hermes
ChatML template), through `AsyncRolloutClient` and through the OpenAI front with the `openai` client.
The tiny model, taught by a real push to call the calculator and then answer, plays whole episodes:
the turn that called the tool comes back with `tool_calls` in one shape either way, the tool's reply
goes back through the template, and the trainer's fp32 forward over each stitched episode gives the
engine's logprob on every policy token."""

import json

import pytest
import torch

from recipes.envs.calculator import Calculator, calculate
from recipes.episodes import Settings, run_episodes
from recipes.turns import ClientTurns, Turn, client_turns, history_message, openai_turns, parsed_message
from rollout import RolloutClient
from rollout.tool_calls import HERMES_CHAT_TEMPLATE, get_tool_parser
from tests.recipes.test_agent_episodes import _policy_logprobs, _tolerance
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_http_tool_calls import _overfit

pytestmark = pytest.mark.timeout(300)

SEED = 3  # the environment seed the model is taught to answer


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    s = Sidecar(qwen2_dir, "--http-port", "0", "--max-model-len", "1024", "--enable-auto-tool-choice",
                "--tool-call-parser", "hermes", "--chat-template", str(HERMES_CHAT_TEMPLATE))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(qwen2_tokenizer):
    return qwen2_tokenizer


def _taught_turns(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) of the episode the model is taught: a call, then the answer after the
    tool's reply; the prompts built by the front's own function with the Hermes template."""
    parser = get_tool_parser("hermes")
    turns = ClientTurns(None, tokenizer, parser, HERMES_CHAT_TEMPLATE.read_text())
    env = Calculator(tools_in_prompt=False)
    first = env.reset(SEED)
    expr = first.messages[-1]["content"].removeprefix("What is ").rstrip("?")
    call = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "\n</tool_call>"
    call_ids = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    p1 = turns.prompt_ids(first.messages, first.tools)
    message = parsed_message(call, parser)
    step = env.step(message, call_ids)
    sent = history_message(Turn(p1, call_ids, [], [], "stop", message))
    p2 = turns.prompt_ids(first.messages + [sent, *step.messages], first.tools)
    answer_ids = tokenizer(f"#### {calculate(expr)}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return [(p1, call_ids), (p2, answer_ids)]


@pytest.fixture(scope="module")
def taught(sidecar, qwen2_dir, tokenizer):
    """The engines serve a policy that plays the SEED episode greedily as taught; (policy, version)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    rows = _taught_turns(tokenizer)
    _overfit(policy, rows)
    client = RolloutClient(sidecar.url, token=TOKEN)
    try:
        client.init_weight_sync()
        version = client.stats()["version"] + 1
        client.push_weights(policy, version=version)
    finally:
        client.close()
    return policy.eval(), version, max(len(c) for _, c in rows)


def _episodes(thread, n: int, max_tokens: int):
    settings = Settings(max_turns=3, max_tokens=max_tokens, temperature=0.0, max_context=1024)
    try:
        return thread.submit(run_episodes, lambda: Calculator(tools_in_prompt=False), [SEED] * n,
                             list(range(n)), settings).result(120)
    finally:
        thread.close()


def _without_ids(message: dict) -> dict:
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", ())]
    return {**{k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}, "tool_calls": calls}


def test_a_tool_calling_episode_is_the_same_and_token_exact_through_either_transport(sidecar, taught, tokenizer):
    policy, version, longest = taught
    parser, template = get_tool_parser("hermes"), HERMES_CHAT_TEMPLATE.read_text()
    got = {"client": _episodes(client_turns(sidecar.url, TOKEN, tokenizer, parser, template), 2, longest + 4),
           "openai": _episodes(openai_turns(sidecar.http_url, TOKEN), 2, longest + 4)}
    for transport, episodes in got.items():
        tol = _tolerance(policy, episodes)
        for ep in episodes:
            assert ep.error is None, (transport, ep.error)
            assert (ep.end, ep.turns, ep.tool_calls, ep.tool_errors) == ("done", 2, 1, 0), transport
            assert ep.reward == pytest.approx(1.2)  # the call's bonus and the right answer
            assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant"]
            called, reply = ep.messages[2], ep.messages[3]
            (call,) = called["tool_calls"]
            assert call["id"].startswith("call_") and reply["tool_call_id"] == call["id"]
            assert call["type"] == "function" and call["function"]["name"] == "calculator"
            assert "result" in json.loads(reply["content"])
            mask = torch.tensor(ep.policy_mask, dtype=torch.bool)
            assert all(v == version for v, m in zip(ep.weight_versions, ep.policy_mask) if m)
            diff = (_policy_logprobs(policy, ep) - torch.tensor(ep.logprobs)).abs()[mask]
            assert diff.max().item() <= tol, (transport, diff.max().item(), tol)
            text = tokenizer.decode(ep.prompt_token_ids + ep.token_ids)
            assert text.count('<tool_call>\n{"name": "calculator"') == 1 and text.count("<tool_response>") == 1
    # one episode, token for token and message for message (but the calls' fresh ids), either way
    a, b = got["client"][0], got["openai"][0]
    assert (a.prompt_token_ids, a.token_ids, a.policy_mask) == (b.prompt_token_ids, b.token_ids, b.policy_mask)
    assert [_without_ids(m) for m in a.messages] == [_without_ids(m) for m in b.messages]
