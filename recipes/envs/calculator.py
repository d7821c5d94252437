"""`Calculator`: arithmetic a small chat model cannot do in its head (SmolLM2-135M multiplies 3- and
4-digit numbers wrong nearly always), with a calculator tool it can call.

The environment reads the tool calls from the assistant's message dict (`tool_calls`, as a tool-call
parser such as `rollout.serve --tool-call-parser hermes` or vLLM's put them), runs each, and answers
one `tool` message per call (with its `tool_call_id`). A turn without tool calls is the answer: the
episode ends and scores 1.0 when its final number (recipes/answers.py) is the right one. Each episode
also earns `call_bonus` once, for its first well-formed call. A call that is malformed (arguments not
JSON, no `expression`, an unknown tool, an expression the calculator refuses) is answered with the
error as the tool's reply and counted in `Step.tool_errors`.

`examples=k` puts k worked exchanges before the question (a user question, the assistant's call,
the tool's reply, the assistant's answer after ####), as OpenAI messages: the template renders each
call as it would render the model's own. SmolLM2-135M-Instruct calls no tool without them (0 calls
in 10 steps of 32 episodes) and hardly under one; the recipe shows three (bench/agent_calculator_probe.py).

The tools go in the request (`Reset.tools`) and, with `tools_in_prompt` (for chat templates that
do not render tools, such as SmolLM2's own), in the system prompt too, in the Hermes format Qwen2.5's
template writes. `python -m recipes.agent` serves such models with the Hermes ChatML template
(rollout.tool_calls.HERMES_CHAT_TEMPLATE), which renders the request's tools: then they are not
written twice."""

from __future__ import annotations

import ast
import json
import operator
import random

from recipes.answers import extract_answer, same_number
from recipes.envs.base import Reset, Step

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression: + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                  "description": "for example 123 * (45 + 6)"}},
                   "required": ["expression"]}}}

INSTRUCTIONS = "You are a careful assistant. You cannot do arithmetic in your head: use the calculator."
HERMES_TOOLS = ("You may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                "</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}}\n</tool_call>")
ANSWER_FORMAT = "When you know the result, answer with #### followed by the number."
SYSTEM = f"{INSTRUCTIONS}\n\n{HERMES_TOOLS}\n\n{ANSWER_FORMAT}"  # .format(tools=...): HERMES_TOOLS' braces

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT = 64  # 2 ** 64 is fine; 9 ** 9 ** 9 would hang the run


class CalculatorError(ValueError):
    """An expression the calculator refuses (its text goes back to the model as the tool's reply)."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses; anything
    else (names, calls, attributes) raises CalculatorError. Never `eval`."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from e
    return _value(tree.body)


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is too large")
        try:
            return _OPS[type(node.op)](left, right)
        except ZeroDivisionError as e:
            raise CalculatorError("division by zero") from e
    raise CalculatorError(f"the calculator takes numbers and + - * / // % ** only, not {ast.unparse(node)!r}")


# the worked exchanges (expressions of the shapes make_question draws): one is not enough for
# SmolLM2-135M (P(a call) ~0.001 under one, ~0.1 under two, ~0.7 under three: bench/agent_calculator_probe.py)
EXAMPLE_EXPRESSIONS = ("4821 * 37 + 506", "9077 * 254", "312 * 4508 + 77")


def example_exchange(expression: str, call_id: str, tools_in_prompt: bool) -> list[dict]:
    """One worked exchange: question, call, the calculator's reply, answer. With `tools_in_prompt`
    (a template that renders no tools nor tool calls) the call is also written out as the text a
    Hermes model writes, so the model sees it either way."""
    arguments = json.dumps({"expression": expression})
    call = {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    text = f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'
    value = calculate(expression)
    return [{"role": "user", "content": f"What is {expression}?"},
            {"role": "assistant", "content": text if tools_in_prompt else None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "name": "calculator", "content": json.dumps({"result": value})},
            {"role": "assistant", "content": f"#### {value}"}]


def make_question(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(100, 9999), rng.randint(12, 999), rng.randint(10, 999)
    if rng.random() < 0.5:
        return f"What is {a} * {b}?", a * b
    return f"What is {a} * {b} + {c}?", a * b + c


class Calculator:
    def __init__(self, call_bonus: float = 0.2, tools_in_prompt: bool = True, examples: int = 0):
        if not 0 <= examples <= len(EXAMPLE_EXPRESSIONS):
            raise ValueError(f"examples: 0 to {len(EXAMPLE_EXPRESSIONS)} worked exchanges, not {examples}")
        self.call_bonus, self.tools_in_prompt, self.examples = call_bonus, tools_in_prompt, examples
        self.answer: int | None = None
        self.bonus_paid = False

    def reset(self, seed: int) -> Reset:
        question, self.answer = make_question(random.Random(seed))
        self.bonus_paid = False
        system = (SYSTEM.format(tools=json.dumps(TOOL["function"])) if self.tools_in_prompt
                  else f"{INSTRUCTIONS}\n\n{ANSWER_FORMAT}")
        shown = [m for i, e in enumerate(EXAMPLE_EXPRESSIONS[:self.examples])
                 for m in example_exchange(e, f"call_example_{i}", self.tools_in_prompt)]
        return Reset([{"role": "system", "content": system}, *shown, {"role": "user", "content": question}],
                     tools=[TOOL])

    def step(self, message: dict, token_ids: list[int]) -> Step:
        calls = message.get("tool_calls") or []
        if not calls:  # the answer
            right = same_number(extract_answer(message.get("content") or ""), str(self.answer))
            return Step(reward=float(right), done=True, metrics={"correct": float(right)})
        replies = [self._call(c) for c in calls]
        errors = sum(not ok for _, ok in replies)
        reward = 0.0
        if errors < len(calls) and not self.bonus_paid:
            reward, self.bonus_paid = self.call_bonus, True
        return Step([m for m, _ in replies], reward=reward, tool_calls=len(calls), tool_errors=errors)

    def _call(self, call: dict) -> tuple[dict, bool]:
        """One tool call -> (its `tool` message, whether it was well-formed and ran)."""
        fn = call.get("function") or {}
        reply = {"role": "tool", "tool_call_id": call.get("id", ""), "name": fn.get("name", "")}
        try:
            if fn.get("name") != "calculator":
                raise CalculatorError(f"unknown tool {fn.get('name')!r}: the only tool is 'calculator'")
            args = json.loads(fn.get("arguments") or "{}")
            if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
                raise CalculatorError('arguments must be {"expression": "..."}')
            value = calculate(args["expression"])
        except (CalculatorError, json.JSONDecodeError) as e:
            return {**reply, "content": json.dumps({"error": str(e)})}, False
        return {**reply, "content": json.dumps({"result": value})}, True
