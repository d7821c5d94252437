"""The agent recipe's environments (recipes/envs), their adapters, and how an episode is stitched and
rewarded: pure code, no sidecar (tests/recipes/test_agent_episodes.py runs them against one)."""

import json
import re

import pytest
import torch

from recipes.batch import build_batch
from recipes.envs import Calculator, Environment, FromGymnasium, FromSkyRL, env_factory
from recipes.envs.calculator import CalculatorError, calculate
from recipes.episode_metrics import episode_metrics, episode_rewards
from recipes.episodes import Episode, StitchError
from recipes.turns import ClientTurns, Turn, history_message, parsed_message
from rollout.sidecar.openai_front.chat_prompt import chat_prompt_ids
from rollout.sidecar.openai_front.schema import ChatMessage
from rollout.tool_calls import HERMES_CHAT_TEMPLATE, get_tool_parser


@pytest.fixture(scope="module")
def tokenizer(qwen2_tokenizer):
    return qwen2_tokenizer


def _hermes_message(text: str) -> dict:
    """The assistant message the episode runner makes of a turn's text on the RolloutClient transport:
    the Hermes tool calls read out of it by rollout.tool_calls' parser (as the OpenAI front's)."""
    return parsed_message(text, get_tool_parser("hermes"))


def test_the_letter_game_scores_each_turn_and_gives_feedback(tokenizer):
    make = env_factory("letters", tokenizer, turns=3, letters="a")
    env = make()
    assert isinstance(env, Environment)
    first = env.reset(seed=1)
    assert first.messages[0]["role"] == "user" and "a" in first.messages[0]["content"] and first.tools is None
    a_ids = tokenizer(" ka sa ta", add_special_tokens=False)["input_ids"]
    o_ids = tokenizer(" mo ru ti", add_special_tokens=False)["input_ids"]
    s1 = env.step({"role": "assistant", "content": " ka sa ta"}, a_ids)
    assert s1.reward == pytest.approx(1 / 3) and not s1.done
    assert s1.messages[0]["content"].startswith(f"{len(a_ids)} of {len(a_ids)} tokens had a")
    s2 = env.step({"role": "assistant", "content": " mo ru ti"}, o_ids)
    assert s2.reward == 0.0 and not s2.done
    s3 = env.step({"role": "assistant", "content": ""}, [tokenizer.eos_token_id])  # only special tokens: 0
    assert s3.done and s3.reward == 0.0 and s3.messages == []


def test_the_letter_game_draws_its_letter_from_the_seed(tokenizer):
    make = env_factory("letters", tokenizer, letters="ae")
    drawn = {make().reset(seed).messages[0]["content"].split()[3].rstrip(",") for seed in range(20)}
    assert drawn == {"a", "e"}
    again = make()
    assert again.reset(7).messages == make().reset(7).messages


def test_the_calculator_evaluates_arithmetic_and_refuses_anything_else():
    assert calculate("123 * (45 + 6)") == 6273
    assert calculate("-2 ** 10 + 7 // 2 % 5") == -1021
    for bad in ["__import__('os')", "x + 1", "2 ** 999", "1 / 0", "3 +", "[1, 2]"]:
        with pytest.raises(CalculatorError):
            calculate(bad)


def test_a_hermes_tool_call_in_the_text_reaches_the_calculator_and_the_answer_ends_the_episode():
    env = Calculator(call_bonus=0.2)
    first = env.reset(seed=3)
    assert first.messages[0]["role"] == "system" and "<tools>" in first.messages[0]["content"]
    assert first.tools[0]["function"]["name"] == "calculator"
    a, b = map(int, re.findall(r"\d+", first.messages[1]["content"])[:2])
    expr = first.messages[1]["content"].removeprefix("What is ").rstrip("?")
    call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
    msg = _hermes_message(f"Let me compute.\n<tool_call>\n{call}\n</tool_call>")
    s = env.step(msg, [1, 2, 3])
    assert (s.tool_calls, s.tool_errors, s.done, s.reward) == (1, 0, False, 0.2)
    reply = s.messages[0]
    assert reply["role"] == "tool" and reply["tool_call_id"] == msg["tool_calls"][0]["id"]
    value = json.loads(reply["content"])["result"]
    assert value == calculate(expr) and value >= a * b
    again = env.step(_hermes_message(f"<tool_call>{call}</tool_call>"), [1])
    assert again.reward == 0.0  # the call bonus is paid once per episode
    right = env.step({"role": "assistant", "content": f"So the answer is #### {value}"}, [4])
    assert right.done and right.reward == 1.0
    env.reset(seed=3)
    wrong = env.step({"role": "assistant", "content": "#### 12"}, [4])
    assert wrong.done and wrong.reward == 0.0


def test_malformed_tool_calls_are_answered_with_their_error_and_counted():
    env = Calculator()
    env.reset(seed=0)
    calls = [{"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{not json"}},
             {"id": "c2", "type": "function", "function": {"name": "search", "arguments": "{}"}},
             {"id": "c3", "type": "function", "function": {"name": "calculator", "arguments": '{"expr": "1"}'}},
             {"id": "c4", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "os"}'}}]
    s = env.step({"role": "assistant", "content": None, "tool_calls": calls}, [1])
    assert (s.tool_calls, s.tool_errors, s.reward, s.done) == (4, 4, 0.0, False)
    assert [m["tool_call_id"] for m in s.messages] == ["c1", "c2", "c3", "c4"]
    assert all("error" in json.loads(m["content"]) for m in s.messages)
    # text that only looks like a call (the parser leaves it as content) is an answer, not a call
    plain = _hermes_message("<tool_call>{oops</tool_call>")
    assert "tool_calls" not in plain and env.step(plain, [1]).done


def test_the_calculator_shows_worked_calls_as_the_template_renders_the_models_own(tokenizer):
    """Three worked exchanges before the question: each call renders (Hermes ChatML template) as the
    text the Hermes parser reads back as that call, each tool reply is the calculator's value of it
    and names it, so the OpenAI front takes the conversation; the answer reports `correct`."""
    from rollout.sidecar.openai_front.chat_tools import check_tool_call_ids

    parser = get_tool_parser("hermes")
    env = Calculator(tools_in_prompt=False, examples=3)
    first = env.reset(seed=3)
    assert [m["role"] for m in first.messages] == ["system"] + ["user", "assistant", "tool", "assistant"] * 3 + ["user"]
    assert first.messages[-1] == Calculator(tools_in_prompt=False).reset(seed=3).messages[-1]
    check_tool_call_ids([ChatMessage.model_validate(m) for m in first.messages])  # no 400
    ids = ClientTurns(None, tokenizer, parser, HERMES_CHAT_TEMPLATE.read_text()).prompt_ids(first.messages, first.tools)
    text = tokenizer.decode(ids)
    shown = re.findall(r"<\|im_start\|>assistant\n(<tool_call>.*?</tool_call>)<\|im_end\|>", text, re.DOTALL)
    calls = [m["tool_calls"][0] for m in first.messages if m.get("tool_calls")]
    assert len(shown) == len(calls) == 3 and text.count("<tool_response>") == 3
    for rendered, call, reply in zip(shown, calls, [m for m in first.messages if m["role"] == "tool"]):
        (read,) = _hermes_message(rendered)["tool_calls"]
        assert read["function"] == call["function"] and reply["tool_call_id"] == call["id"]
        expression = json.loads(call["function"]["arguments"])["expression"]
        assert json.loads(reply["content"]) == {"result": calculate(expression)}
    assert text.endswith(first.messages[-1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    # a template that renders no tool calls (SmolLM2's own) shows them as the text all the same
    plain = Calculator(tools_in_prompt=True, examples=3).reset(seed=3)
    own = tokenizer.decode(chat_prompt_ids([ChatMessage.model_validate(m) for m in plain.messages], tokenizer,
                                           chat_template=SMOLLM2))
    assert own.count('<tool_call>\n{"name": "calculator", "arguments": {"expression": ') == 3
    assert env.step({"role": "assistant", "content": f"#### {env.answer}"}, [1]).metrics == {"correct": 1.0}
    env.reset(seed=3)
    assert env.step({"role": "assistant", "content": "#### 1"}, [1]).metrics == {"correct": 0.0}
    with pytest.raises(ValueError, match="0 to 3"):
        Calculator(examples=4)


# The shape of Qwen2.5's template (its tools block shortened): it renders an assistant turn's
# `tool_calls` itself, after a newline of its own, not as the model wrote them.
QWEN25_SHAPED = """{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}{%- for t in tools %}{{- t | tojson }}
{%- endfor %}{{- '</tools><|im_end|>\n' }}{%- endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}{{- '<|im_start|>assistant' }}
{%- if m.content %}{{- '\n' + m.content }}{%- endif %}
{%- for c in m.tool_calls %}{{- '\n<tool_call>\n{"name": "' + c.function.name + '", "arguments": '
    + (c.function.arguments | tojson) + '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}
{%- elif m.role == "tool" %}{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}
{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

# SmolLM2-135M-Instruct's own template (its chat_template.jinja): content added to text, no tools
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _sampled(tokenizer, text: str) -> list[int]:
    """Ids for `text` one character at a time, then EOS: a segmentation the model may sample and
    re-tokenising the text never gives back."""
    ids = [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    assert ids != tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids + [tokenizer.eos_token_id]


@pytest.mark.parametrize("template", ["hermes", "qwen2.5-shaped"])
def test_a_tool_calling_episode_is_stitched_token_for_token(tokenizer, template):
    """Three calculator turns on the RolloutClient transport (the front's own prompt function, the
    Hermes parser): a call, two calls, the answer. Each turn is spliced into the next prompts as its
    sampled ids, and rendered once, though both templates render `tool_calls` themselves."""
    parser = get_tool_parser("hermes")
    turns = ClientTurns(None, tokenizer, parser, HERMES_CHAT_TEMPLATE.read_text() if template == "hermes"
                        else QWEN25_SHAPED)
    env = Calculator(tools_in_prompt=False)  # the template renders the tools
    first = env.reset(seed=3)
    expr = first.messages[1]["content"].removeprefix("What is ").rstrip("?")

    def call(e):
        return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": e}}) + "\n</tool_call>"

    said = [f"Let me compute.\n{call(expr)}", f"{call(expr)}\n{call('2 + 2')}", f"It is #### {calculate(expr)}"]
    ep, messages = Episode(), list(first.messages)
    for text in said:
        ids = _sampled(tokenizer, text)
        turn = Turn(turns.prompt_ids(messages, first.tools), ids, [-1.0] * len(ids), [0] * len(ids), "stop",
                    parsed_message(tokenizer.decode(ids, skip_special_tokens=True), parser))
        ep.add_turn(turn)  # StitchError unless the prompt extends the episode so far token for token
        step = env.step(turn.message, turn.token_ids)
        messages += [history_message(turn), *step.messages]
        ep.reward += step.reward
    assert step.done and ep.reward == pytest.approx(1.2) and ep.turns == 3
    called = messages[2]
    assert called["content"] == "Let me compute.\n" and called["token_ids"] == _sampled(tokenizer, said[0])
    assert [set(c) for c in called["tool_calls"]] == [{"id", "type", "function"}]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == [
        c["id"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", ())]
    whole = turns.prompt_ids(messages, first.tools)  # the next turn's prompt: the whole episode as sampled
    assert whole[:len(ep.prompt_token_ids) + len(ep.token_ids)] == ep.prompt_token_ids + ep.token_ids
    text = tokenizer.decode(whole)
    assert text.count('<tool_call>\n{"name": "calculator"') == 3 and text.count("<tool_response>") == 3
    assert text.count("# Tools") == 1
    assert sum(ep.policy_mask) == sum(len(_sampled(tokenizer, t)) for t in said)


def test_an_assistant_turn_without_content_renders_under_smollm2s_template(tokenizer):
    """An agent framework sends a tool-calling turn back as OpenAI writes it (content null, no
    token_ids): rendered with "" as vLLM does, not refused by a template that adds content to text."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    ids = chat_prompt_ids([ChatMessage.model_validate(m) for m in messages], tokenizer, chat_template=SMOLLM2)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n"
                                          "<|im_start|>assistant\n")


class _SkyRLCounter:
    """A SkyRL-gym-shaped text environment (init / step -> observations dict / close)."""

    def __init__(self, target: int):
        self.target, self.closed = target, False

    def init(self, prompt):
        return prompt, {"target": self.target}

    def step(self, action: str):
        done = str(self.target) in action
        return {"observations": [] if done else [{"role": "user", "content": "no, again"}],
                "reward": float(done), "done": done, "metadata": {}}

    def close(self):
        self.closed = True


class _GymGuess:
    """A Gymnasium-shaped text environment (reset(seed=) -> (obs, info); five-tuple step)."""

    def reset(self, seed=None):
        self.target = seed % 10
        return f"guess a digit ({seed})", {}

    def step(self, action: str):
        right = str(self.target) in action
        return ("right" if right else "higher or lower?"), float(right), right, False, {}


def test_skyrl_and_gymnasium_text_environments_plug_in_through_the_adapters(tokenizer):
    made = []

    def make(seed):
        made.append(_SkyRLCounter(seed))
        return made[-1], [{"role": "user", "content": f"say {seed}"}]

    sky = FromSkyRL(make, tokenizer)
    assert isinstance(sky, Environment) and sky.reset(42).messages == [{"role": "user", "content": "say 42"}]
    ids = tokenizer("no idea", add_special_tokens=False)["input_ids"]
    s = sky.step({"role": "assistant", "content": "ignored: the raw text is decoded"}, ids)
    assert (s.done, s.reward, s.messages) == (False, 0.0, [{"role": "user", "content": "no, again"}])
    s = sky.step({"role": "assistant", "content": ""}, tokenizer("it is 42", add_special_tokens=False)["input_ids"])
    assert s.done and s.reward == 1.0 and made[0].closed

    gym = FromGymnasium(_GymGuess(), tokenizer, system="play")
    assert [m["role"] for m in gym.reset(13).messages] == ["system", "user"]
    s = gym.step({}, tokenizer("5", add_special_tokens=False)["input_ids"])
    assert s.messages == [{"role": "user", "content": "higher or lower?"}] and not s.done
    s = gym.step({}, tokenizer("3", add_special_tokens=False)["input_ids"])
    assert s.done and s.reward == 1.0 and s.messages == []


def _turn(prompt, ids, version=0):
    return Turn(prompt, ids, [-1.0] * len(ids), [version] * len(ids), "length", {"role": "assistant", "content": ""})


def test_an_episode_stitches_turns_and_masks_everything_but_the_policy():
    ep = Episode()
    ep.add_turn(_turn([1, 2, 3], [10, 11]))
    ep.add_turn(_turn([1, 2, 3, 10, 11, 4, 5], [12], version=1))
    assert ep.prompt_token_ids == [1, 2, 3] and ep.token_ids == [10, 11, 4, 5, 12]
    assert ep.policy_mask == [1, 1, 0, 0, 1] and ep.weight_versions == [0, 0, -1, -1, 1]
    assert ep.logprobs == [-1.0, -1.0, 0.0, 0.0, -1.0] and ep.start_version == 0 and ep.turns == 2
    with pytest.raises(StitchError, match="does not extend"):
        ep.add_turn(_turn([1, 2, 3, 10, 99], [13]))  # a re-tokenised earlier turn
    failed = Episode(prompt_token_ids=[1], token_ids=[5, 6], policy_mask=[1, 1], logprobs=[0.0, 0.0],
                     weight_versions=[0, 0], error="ValueError: boom")
    batch = build_batch([ep, failed], pad_id=0)
    assert batch.mask.tolist() == [[1, 1, 0, 0, 1], [0, 0, 0, 0, 0]]
    assert batch.targets[0].tolist() == [10, 11, 4, 5, 12]


def test_a_failed_episode_takes_its_groups_mean_reward():
    eps = [Episode(reward=r, error=e) for r, e in [(1.0, None), (0.0, "boom"), (0.5, None), (0.0, None)]]
    assert episode_rewards(eps, group_size=2).tolist() == [1.0, 1.0, 0.5, 0.0]
    m = episode_metrics(eps)
    assert m["episodes/errors"] == 1 and m["episodes/well_formed_calls"] == 0.0
    assert torch.isfinite(torch.tensor(list(m.values()), dtype=torch.float)).all()


def test_a_steps_metrics_count_calls_that_ran_refused_requests_and_the_environments_numbers():
    eps = [Episode(tool_calls=2, tool_errors=1, metrics={"correct": 1.0}), Episode(tool_calls=1, tool_errors=1),
           Episode(metrics={"correct": 0.0}), Episode(error="TurnError: HTTP 400", error_in="turn")]
    m = episode_metrics(eps)
    assert m["episodes/called_well"] == 0.25 and m["episodes/well_formed_calls"] == pytest.approx(1 / 3)
    assert m["episodes/turn_errors"] == 1 == m["episodes/errors"] and m["env/correct"] == 0.25
    assert "env/correct" not in episode_metrics([Episode()])
