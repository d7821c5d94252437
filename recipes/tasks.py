"""Tasks: prompts and a reward in [0, 1] for each completion.

- `AGame`: the toy task the embedded tiny model learns on CPU in minutes, with no data and no
  warm start. The prompt asks for words full of the letter "a"; the reward is the fraction of
  completion tokens whose text contains an "a". A random model scores ~0.3; the policy learns
  to prefer those tokens.
- `JsonlTask`: prompt / answer pairs from a local JSONL file (GSM8K's format: "question" and an
  "answer" ending in "#### <number>", or "prompt" / "answer"), with an exact-match reward on
  the final answer, so the same recipe trains a real model on a real data set.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path


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


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """GSM8K convention: the answer after '####', else the last number in the text."""
    if "####" in text:
        text = text.split("####")[-1]
    nums = _NUMBER.findall(text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


class JsonlTask:
    name = "jsonl"

    def __init__(self, path: str, seed: int = 0, template: str = "Question: {q}\nAnswer:"):
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{path} holds no examples")
        self.items = []
        for i, d in enumerate(lines):
            q = d.get("prompt", d.get("question"))
            a = d.get("answer")
            if q is None or a is None:
                raise ValueError(f"{path}:{i + 1}: needs 'prompt' (or 'question') and 'answer'")
            self.items.append({"prompt": template.format(q=q), "answer": final_number(str(a)) or str(a).strip()})
        self.rng = random.Random(seed)

    def prompts(self, n: int) -> list[dict]:
        return [self.rng.choice(self.items) for _ in range(n)]

    def reward(self, item: dict, completion_ids: list[int], text: str) -> float:
        return float(final_number(text) == item["answer"])


def make_task(name: str, tokenizer, data: str | None = None, seed: int = 0):
    if name == "a-game":
        return AGame(tokenizer, seed)
    if name == "jsonl":
        if not data:
            raise ValueError("--task jsonl needs --data PATH.jsonl")
        return JsonlTask(data, seed)
    raise ValueError(f"unknown task {name!r}; expected 'a-game' or 'jsonl'")
