"""Environments for multi-turn agent RL (`python -m recipes.agent`): the interface (base.py), two
built in (letters.py: a game the tiny model learns; calculator.py: a real tool for SmolLM2) and
adapters for SkyRL-gym and Gymnasium-style text environments (adapters.py)."""

from __future__ import annotations

from collections.abc import Callable

from recipes.envs.adapters import FromGymnasium, FromSkyRL
from recipes.envs.base import Environment, Reset, Step
from recipes.envs.calculator import Calculator
from recipes.envs.letters import LetterGame, tokens_with

ENVIRONMENTS = ["letters", "calculator"]

__all__ = ["ENVIRONMENTS", "Calculator", "Environment", "FromGymnasium", "FromSkyRL", "LetterGame", "Reset", "Step",
           "env_factory"]


def env_factory(name: str, tokenizer, turns: int = 3, letters: str = "a",
                tools_in_prompt: bool = True, examples: int = 3) -> Callable[[], Environment]:
    """A function that makes a fresh environment of `name` per episode (what is costly to build,
    such as the letter game's token table, built once here). `tools_in_prompt`: the calculator
    writes its tool into the system prompt (for a chat template that renders no tools); `examples`:
    the worked exchanges it shows before the question (0 to 3)."""
    if name == "letters":
        table = {c: tokens_with(tokenizer, c) for c in letters}
        return lambda: LetterGame(tokenizer, turns, letters, table)
    if name == "calculator":
        return lambda: Calculator(tools_in_prompt=tools_in_prompt, examples=examples)
    raise ValueError(f"unknown environment {name!r}; expected one of {ENVIRONMENTS}")
