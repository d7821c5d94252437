"""Tasks: prompts, and a reward for each completion.

- `AGame`: the toy task the embedded tiny model learns on CPU in minutes, with no data and no
  warm start. The prompt asks for words full of the letter "a"; the reward is the fraction of
  completion tokens whose text contains an "a". A random model scores ~0.3; the policy learns
  to prefer those tokens.
- `ArithmeticTask`: arithmetic word problems generated offline from the seed, at a difficulty
  level (recipes/arithmetic.py); `JsonlTask`: GSM8K's JSONL ("question" and an "answer" ending
  in "#### <number>", or "prompt" / "answer"). Both are verifiable: the final answer is read out
  of the completion (recipes/answers.py) and compared as a number.

Verifiable rewards: 1.0 for the right number, 0.0 otherwise, plus `format_reward` (W, default 0)
when the completion answers in the requested format, so each reward lies in [0, 1 + W].
`reward_parts` gives the two apart, for logging correctness alone (`reward_metrics`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from recipes.answers import canonical, extract_answer, instruction, parse_number, same_number, uses_format
from recipes.arithmetic import make_problem

TASKS = ["a-game", "arithmetic", "gsm8k", "jsonl"]  # jsonl: another name for gsm8k


class AGame:
    name = "a-game"
    WORDS = "ka sa ta pa da ja la ma na ra va wa ya za mo ru ti ne".split()

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        vocab = tokenizer.get_vocab()
        self.good = {i for tok, i in vocab.items() if "a" in tokenizer.convert_tokens_to_string([tok])}

    def prompts(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            words = " ".join(self.rng.choice(self.WORDS) for _ in range(self.rng.randint(2, 5)))
            out.append({"prompt": f"Q: say words with a, like {words}. A:", "answer": None})
        return out

    def reward(self, item: dict, completion_ids: list[int], text: str) -> float:
        ids = [t for t in completion_ids if t != self.tokenizer.eos_token_id]
        return sum(t in self.good for t in ids) / len(ids) if ids else 0.0


def final_number(text: str) -> str | None:
    """The final answer of `text` as a canonical number string ("1,234.0" -> "1234"), or None."""
    value = parse_number(extract_answer(text))
    return None if value is None else canonical(value)


# A short system prompt keeps a small chat model to the point: SmolLM2-135M-Instruct, level 1 at
# temperature 0.7, was right 17% of the time with it and 12% without (it rambles on past the answer).
SYSTEM_PROMPT = "You are a careful math tutor. Solve each problem in one short step."


def make_prompt(question: str, tokenizer=None, answer_format: str = "hashes") -> str | list[dict]:
    """A conversation asking for the answer in `answer_format` when the tokenizer has a chat
    template (a chat model answers its own template best), else a plain completion prompt."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"{question}\n{instruction(answer_format)}"}]
    return f"Question: {question}\nAnswer:"


class AnswerReward:
    """Correctness (1/0, numeric comparison) plus `format_reward` when the completion uses
    `answer_format`: each reward lies in [0, 1 + format_reward]."""

    def __init__(self, answer_format: str = "hashes", format_reward: float = 0.0):
        instruction(answer_format)  # an unknown format fails here, not at the first reward
        self.answer_format = answer_format
        self.format_reward = format_reward

    def reward_parts(self, item: dict, completion_ids: list[int], text: str) -> dict[str, float]:
        return {"correct": float(same_number(extract_answer(text), item["answer"])),
                "format": float(uses_format(text, self.answer_format))}

    def reward(self, item: dict, completion_ids: list[int], text: str) -> float:
        parts = self.reward_parts(item, completion_ids, text)
        return parts["correct"] + self.format_reward * parts["format"]


class ArithmeticTask(AnswerReward):
    name = "arithmetic"

    def __init__(self, tokenizer=None, level: int = 1, seed: int = 0, **reward_args):
        super().__init__(**reward_args)
        make_problem(random.Random(0), level)  # an unknown level fails here
        self.tokenizer, self.level = tokenizer, level
        self.rng = random.Random(seed)

    def prompts(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            p = make_problem(self.rng, self.level)
            out.append({"prompt": make_prompt(p.question, self.tokenizer, self.answer_format),
                        "answer": str(p.answer), "question": p.question, "expr": p.expr})
        return out


def read_gsm8k(path: str) -> list[tuple[str, str]]:
    """(question, canonical final answer) per line of a GSM8K-format JSONL file; a malformed line
    raises ValueError naming the file and line."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        q = d.get("prompt", d.get("question")) if isinstance(d, dict) else None
        a = d.get("answer") if isinstance(d, dict) else None
        if q is None or a is None:
            raise ValueError(f"{path}:{n}: needs 'question' (or 'prompt') and 'answer'")
        value = parse_number(extract_answer(str(a)))
        if value is None:
            raise ValueError(f"{path}:{n}: the answer has no final number (GSM8K's ends in '#### <number>')")
        out.append((str(q), canonical(value)))
    if not out:
        raise ValueError(f"{path} holds no examples")
    return out


class JsonlTask(AnswerReward):
    """GSM8K (`--task gsm8k`, or `jsonl`): questions drawn with replacement from a local file."""

    name = "gsm8k"

    def __init__(self, path: str, seed: int = 0, tokenizer=None, **reward_args):
        super().__init__(**reward_args)
        self.items = [{"prompt": make_prompt(q, tokenizer, self.answer_format), "answer": a, "question": q}
                      for q, a in read_gsm8k(path)]
        self.rng = random.Random(seed)

    def prompts(self, n: int) -> list[dict]:
        return [self.rng.choice(self.items) for _ in range(n)]


def reward_metrics(task, items: list[dict], groups: list[list]) -> dict[str, float]:
    """Mean of each reward part over a step's rollouts ("reward/correct", "reward/format"), for
    tasks that have parts; {} for the others."""
    if not hasattr(task, "reward_parts"):
        return {}
    parts = [task.reward_parts(it, r.token_ids, r.text) for it, g in zip(items, groups) for r in g]
    return {f"reward/{k}": sum(p[k] for p in parts) / len(parts) for k in parts[0]} if parts else {}


def make_task(name: str, tokenizer, data: str | None = None, seed: int = 0, level: int = 1,
              format_reward: float = 0.0, answer_format: str = "hashes"):
    reward_args = {"answer_format": answer_format, "format_reward": format_reward}
    if name == "a-game":
        return AGame(tokenizer, seed)
    if name == "arithmetic":
        return ArithmeticTask(tokenizer, level, seed, **reward_args)
    if name in ("gsm8k", "jsonl"):
        if not data:
            raise ValueError(f"--task {name} needs --data PATH.jsonl")
        return JsonlTask(data, seed, tokenizer, **reward_args)
    raise ValueError(f"unknown task {name!r}; expected one of {TASKS}")
