"""`LetterGame`: the multi-turn game the embedded tiny model learns on the CPU in minutes.

Each turn the user asks for words with a letter; the assistant answers; the user says how it did
("5 of 16 tokens had an 'a'") and asks again. A turn scores the share of its tokens whose text holds
the letter (the a-game of recipes/tasks.py, turn by turn); the episode's reward is the mean over its
turns, in [0, 1]. A random tiny model scores ~0.3 and learns to say the letter's tokens. With several
`letters` each episode draws its letter from its seed, and the policy must read the request."""

from __future__ import annotations

import random

from recipes.envs.base import Reset, Step

WORDS = "ka sa ta pa da ja la ma na ra va wa ya za mo ru ti ne".split()


def tokens_with(tokenizer, letter: str) -> frozenset[int]:
    """The ids of the tokens whose text holds `letter` (one walk over the vocabulary)."""
    return frozenset(i for tok, i in tokenizer.get_vocab().items() if letter in tokenizer.convert_tokens_to_string([tok]))


class LetterGame:
    def __init__(self, tokenizer, turns: int = 3, letters: str = "a", table: dict[str, frozenset[int]] | None = None):
        """`table`: letter -> tokens_with(letter), shared by the episodes of a run (else built here)."""
        if turns < 1 or not letters:
            raise ValueError("LetterGame needs turns >= 1 and at least one letter")
        self.tokenizer, self.turns, self.letters = tokenizer, turns, letters
        self.table = table if table is not None else {c: tokens_with(tokenizer, c) for c in letters}
        self.letter = letters[0]
        self.turn = 0

    def reset(self, seed: int) -> Reset:
        rng = random.Random(seed)
        self.letter = rng.choice(self.letters)
        self.turn = 0
        like = " ".join(rng.choice([w for w in WORDS if self.letter in w] or WORDS) for _ in range(rng.randint(2, 4)))
        return Reset([{"role": "user", "content": f"Say words with {self.letter}, like {like}."}])

    def step(self, message: dict, token_ids: list[int]) -> Step:
        ids = [t for t in token_ids if t not in self.tokenizer.all_special_ids]
        hits = sum(t in self.table[self.letter] for t in ids)
        score = hits / len(ids) if ids else 0.0
        self.turn += 1
        done = self.turn >= self.turns
        feedback = [] if done else [{"role": "user", "content": (
            f"{hits} of {len(ids)} tokens had {self.letter}. Again, words with {self.letter}.")}]
        return Step(feedback, reward=score / self.turns, done=done)
