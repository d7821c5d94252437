"""Verifiable tasks: answer extraction, the seeded arithmetic generator, GSM8K files, rewards and
prompts (conversations for a tokenizer with a chat template, plain strings without)."""

from __future__ import annotations

import ast
import copy
import json
import operator
import random
import re
from fractions import Fraction
from types import SimpleNamespace

import pytest

from recipes.answers import extract_answer, parse_number, same_number, uses_format
from recipes.arithmetic import LEVELS, make_problem
from recipes.tasks import AGame, ArithmeticTask, JsonlTask, make_task, reward_metrics

# (completion, the answer it gives)
EXTRACTIONS = [
    ("#### 42", "42"),
    ("3 + 4 = 7\n#### 7", "7"),
    ("The total is 1,234 apples.", "1,234"),
    ("He pays $1,234.50 in total", "1,234.50"),
    ("It costs $12.", "12"),
    ("-5 degrees", "-5"),
    ("The temperature drops to \u22123.", "-3"),
    ("The answer is 12 apples.", "12"),
    ("So the answer is: $30", "30"),
    ("Answer: **8**", "8"),
    ("The answer is 3 + 4 = 7", "7"),  # an equation: its result
    ("#### 6 + 3 = 9", "9"),
    ("\\boxed{5 \\times 3 = 15}", "15"),
    ("The answer is 12. Check: 5 + 7 = 12, and 3 more is 15", "12"),  # only the answer's sentence
    ("The answer is: Tom has 9 apples", "9"),
    ("3,4 and 5", "5"),  # a list, not 34
    ("1,2345 items", "2345"),
    ("50% of them", "50"),
    ("\\boxed{17}", "17"),
    ("first \\boxed{3} then \\boxed{5}", "5"),  # the last box
    ("\\boxed{\\text{5 apples}}", "5"),  # nested braces
    ("$\\boxed{\\$1,200}$ dollars", "1,200"),
    ("\\boxed{12} and then #### 9", "12"),  # a box beats ####
    ("#### 9\nThe answer is 4", "9"),  # #### beats "answer is"
    ("The answer is 4. Then 5 more things: 6", "4"),  # "answer is" beats the last number
    ("#### 8\n\nQuestion: Tom has 3 apples and buys 4 more.", "8"),  # the model runs on into a new question
    ("Tom has 3 apples and buys 4 more, so he has 7.", "7"),  # numbers of the question echoed first
    ("8-3=5", "5"),  # subtraction, not -3
    ("12kg of flour", "12"),  # units
    ("\\boxed{x}, so 6", "6"),  # an empty-of-numbers box falls through
    ("####\n\n11", "11"),
    ("12.0", "12.0"),
    # as SmolLM2-135M-Instruct writes them
    ("Tom has 11 - 7 = 2 shells left.", "2"),
    ("9 + 2 = 11 balloons.\n##### 11\nThe final answer is 11.", "11"),
    ("#### 10\n105", "10"),
    ("#### #9", "9"),
]
NO_ANSWER = ["", "no numbers here", "H2O and x2", "\\boxed{", "the answer is seven", "\\boxed{}", "####"]


@pytest.mark.parametrize("text,want", EXTRACTIONS)
def test_the_final_answer_is_found_where_the_model_put_it(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize("text", NO_ANSWER)
def test_text_without_a_number_has_no_answer(text):
    assert extract_answer(text) is None


def test_an_unclosed_box_is_ignored_and_the_last_number_is_read():
    assert extract_answer("so 4 \\boxed{5") == "5"
    assert extract_answer("\\boxed{2} and \\boxed{3") == "2"


def test_numbers_compare_as_numbers_not_strings():
    assert same_number("12.0", "12") and same_number("1,234", "1234") and same_number("$5.", "5")
    assert same_number("-3", "-3.00") and same_number("\u22123", "-3")
    assert not same_number("12.5", "12") and not same_number("3", "-3") and not same_number("1,23", "123")
    assert not same_number(None, "1") and not same_number("seven", "7") and not same_number("1 2", "12")
    assert parse_number("12.50") == Fraction(25, 2)


@pytest.mark.parametrize("text,hashes,boxed", [
    ("3 + 4 = 7\n#### 7", True, False),
    ("#### 1,234.", True, False),
    ("#### 7\nthat's all", False, False),  # not the last line
    ("the answer is 7", False, False),
    ("so \\boxed{7}.", False, True),
    ("\\boxed{}", False, False),
    ("#### seven", False, False),
])
def test_the_format_is_the_requested_one(text, hashes, boxed):
    assert uses_format(text, "hashes") == hashes
    assert uses_format(text, "boxed") == boxed


# -- the arithmetic generator ----------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(expr: str) -> Fraction:
    """The exact value of +, -, *, / over integer literals: an evaluator of the test's own."""
    def ev(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        assert isinstance(node, ast.Constant) and isinstance(node.value, int), ast.dump(node)
        return Fraction(node.value)
    return ev(ast.parse(expr, mode="eval").body)


def _problems(level: int, seed: int, n: int = 200):
    rng = random.Random(seed)
    return [make_problem(rng, level) for _ in range(n)]


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_every_answer_is_the_value_of_the_problems_own_numbers(level):
    for p in _problems(level, seed=level):
        value = _evaluate(p.expr)
        assert value.denominator == 1 and value == p.answer and p.answer >= 0, p
        in_text = [int(x) for x in re.findall(r"\d+", p.question)]
        in_expr = [int(x) for x in re.findall(r"\d+", p.expr)]
        assert sorted(in_text) == sorted(in_expr), p  # the computation uses exactly the question's numbers


def test_the_same_seed_gives_the_same_problems_and_other_seeds_others():
    for level in LEVELS:
        assert _problems(level, 7, 50) == _problems(level, 7, 50)
        assert _problems(level, 7, 50) != _problems(level, 8, 50)
    a, b = ArithmeticTask(None, 2, seed=3), ArithmeticTask(None, 2, seed=3)
    assert a.prompts(20) == b.prompts(20)
    assert a.prompts(5) != ArithmeticTask(None, 2, seed=4).prompts(5)


def test_levels_grow_harder():
    def stats(level):
        ps = _problems(level, seed=0, n=300)
        ops = sum(len(re.findall(r"[-+*/]", p.expr)) for p in ps) / len(ps)
        return ops, max(p.answer for p in ps), any("*" in p.expr or "/" in p.expr for p in ps)
    (ops1, max1, mul1), (ops2, max2, mul2), (ops3, max3, mul3), (ops4, max4, mul4) = map(stats, (1, 2, 3, 4))
    assert ops1 == 1 and ops2 == 2 and ops3 == 2 and ops4 >= 2.5
    assert max1 < 20 < max2 and max2 < max3 < max4
    assert not mul1 and not mul2 and mul3 and mul4
    with pytest.raises(ValueError, match="level"):
        ArithmeticTask(None, 9)


# -- prompts and rewards ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(qwen2_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(qwen2_dir)  # the tiny model's, as `--model tiny` has it


def test_a_chat_tokenizer_gets_a_conversation_and_a_plain_one_a_string(tokenizer):
    assert tokenizer.chat_template
    item = ArithmeticTask(tokenizer, 1, seed=0).prompts(1)[0]
    system, user = item["prompt"]
    assert system["role"] == "system" and user["role"] == "user"
    assert user["content"].startswith(item["question"]) and "####" in user["content"]
    text = tokenizer.apply_chat_template(item["prompt"], add_generation_prompt=True, tokenize=False)
    assert item["question"] in text and text.endswith("<|im_start|>assistant\n")
    boxed = ArithmeticTask(tokenizer, 1, seed=0, answer_format="boxed").prompts(1)[0]
    assert "\\boxed{}" in boxed["prompt"][-1]["content"]

    plain_tokenizer = copy.deepcopy(tokenizer)
    plain_tokenizer.chat_template = None
    plain = ArithmeticTask(plain_tokenizer, 1, seed=0).prompts(1)[0]
    assert plain["prompt"] == f"Question: {item['question']}\nAnswer:"
    assert AGame(tokenizer).prompts(1)[0]["prompt"].startswith("Q: say words")  # the toy task keeps its strings


def test_reward_is_correctness_plus_the_format_weight(tokenizer):
    task = make_task("arithmetic", tokenizer, seed=0, level=1, format_reward=0.25)
    item = task.prompts(1)[0]
    right, wrong = item["answer"], str(int(item["answer"]) + 1)
    assert task.reward(item, [], f"I think it is {right}") == 1.0
    assert task.reward(item, [], f"so\n#### {right}") == 1.25
    assert task.reward(item, [], f"so\n#### {wrong}") == 0.25
    assert task.reward(item, [], "no idea") == 0.0
    assert task.reward_parts(item, [], f"#### {right}.0") == {"correct": 1.0, "format": 1.0}
    plain = make_task("arithmetic", tokenizer, seed=0, level=1)
    assert plain.reward(item, [], f"so\n#### {right}") == 1.0  # W = 0: correctness alone


def test_reward_metrics_log_correctness_alone(tokenizer):
    task = make_task("arithmetic", tokenizer, seed=1, level=2, format_reward=0.5)
    items = task.prompts(2)
    r = lambda text: SimpleNamespace(token_ids=[], text=text)  # noqa: E731
    groups = [[r(f"#### {items[0]['answer']}"), r("#### 0")], [r(items[1]["answer"]), r("")]]
    assert reward_metrics(task, items, groups) == {"reward/correct": 0.5, "reward/format": 0.5}
    assert reward_metrics(AGame(tokenizer), items, groups) == {}


# -- GSM8K -----------------------------------------------------------------------------------

def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_gsm8k_lines_give_questions_and_numeric_answers(tmp_path, tokenizer):
    path = _write(tmp_path / "gsm8k.jsonl", [
        {"question": "Tom has 1,000 apples and eats 766. How many are left?",
         "answer": "1,000 - 766 = <<1000-766=234>>234\n#### 234"},
        "",
        {"question": "Sara owes 5 dollars and pays 8. What is her balance?", "answer": "5 - 8 = -3\n#### -3"},
        {"prompt": "Half of 3,000?", "answer": "1,500"},
    ])
    for name in ("gsm8k", "jsonl"):
        task = make_task(name, tokenizer, path, seed=0)
        assert [i["answer"] for i in task.items] == ["234", "-3", "1500"]
        assert task.items[0]["prompt"][-1]["content"].startswith("Tom has 1,000 apples")
    assert task.reward(task.items[0], [], "1000 - 766 = 234 apples.") == 1.0
    assert task.reward(task.items[1], [], "her balance is \\boxed{-3}") == 1.0
    assert task.reward(task.items[2], [], "#### 1,500.00") == 1.0
    assert task.reward(task.items[0], [], "Tom has 1,000 apples") == 0.0
    assert JsonlTask(path).items[2]["prompt"] == "Question: Half of 3,000?\nAnswer:"  # no tokenizer: plain
    assert make_task("gsm8k", tokenizer, path, seed=5).prompts(6) == make_task("gsm8k", tokenizer, path, 5).prompts(6)


@pytest.mark.parametrize("bad,message", [
    ('{"question": "2 + 2?", "answer": "#### 4"', "not valid JSON"),
    ('{"question": "2 + 2?"}', "needs 'question'"),
    ('["2 + 2?", "4"]', "needs 'question'"),
    ('{"question": "2 + 2?", "answer": "four"}', "no final number"),
])
def test_a_malformed_gsm8k_line_is_named_by_file_and_line(tmp_path, tokenizer, bad, message):
    path = _write(tmp_path / "bad.jsonl", [{"question": "1 + 1?", "answer": "#### 2"}, "", bad])
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(message)):
        make_task("gsm8k", tokenizer, path)


def test_gsm8k_needs_a_file_and_an_unknown_task_is_refused(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="--data"):
        make_task("gsm8k", tokenizer, None)
    with pytest.raises(ValueError, match="no examples"):
        make_task("gsm8k", tokenizer, _write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess", tokenizer)


def test_task_dependent_defaults_fill_only_what_the_user_left_out():
    from recipes.rl_train import build_parser
    from recipes.task_defaults import TOY, VERIFIABLE, fill_task_defaults

    def parse(*argv):
        return vars(fill_task_defaults(build_parser("grpo").parse_args(list(argv))))

    toy, real = parse(), parse("--task", "arithmetic")
    assert {k: toy[k] for k in TOY} == TOY and {k: real[k] for k in VERIFIABLE} == VERIFIABLE
    assert real["lr"] < toy["lr"]  # a pretrained model is fine-tuned, not trained from scratch
    mine = parse("--task", "arithmetic", "--lr", "3e-4", "--format-reward", "0")
    assert mine["lr"] == 3e-4 and mine["format_reward"] == 0.0 and mine["max_tokens"] == VERIFIABLE["max_tokens"]
    assert "1e-05 for arithmetic/gsm8k" in " ".join(build_parser("ppo").format_help().split())
