"""The environment interface of the agent recipe (`python -m recipes.agent`): one object per episode.

    env = make_env("letters", tokenizer)          # or any object with these two methods
    first = env.reset(seed)                       # Reset: the first messages, and the tools offered
    step = env.step(message, token_ids)           # the assistant's turn -> Step
    # message: the turn as an OpenAI chat message dict: {"role": "assistant", "content": str | None,
    #          "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]} (tool_calls
    #          only when the turn called tools, as a tool-call parser read them from the text)
    # token_ids: the ids the policy sampled for it (for token-level scores; never re-tokenise the text)
    # step.messages: what the environment answers (user or tool messages, OpenAI's shape), appended
    #          to the conversation before the next turn; step.reward: this turn's reward (an episode's
    #          reward is the sum); step.done: the episode ends here; step.metrics: numbers for the logs
    #          (the calculator's {"correct": 0.0 | 1.0}), logged per step as env/NAME

The recipe runs the episode (recipes/episodes.py): it asks the sidecar for each assistant turn, calls
`step`, and trains on the assistant's tokens only; whatever an environment writes is context, masked
out of the loss. An environment that raises ends its episode (logged; the run goes on).
Environments written for SkyRL-gym or Gymnasium's text API plug in through recipes/envs/adapters.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class Reset:
    """An episode's start: the conversation so far (system / user messages) and the tools offered
    (OpenAI's `tools` list; None when the environment offers none)."""

    messages: list[dict]
    tools: list[dict] | None = None


@dataclass
class Step:
    """What the environment answers to one assistant turn. `tool_calls`: the calls the turn made;
    `tool_errors`: how many of them failed (malformed arguments, an unknown tool, an error of the
    tool itself): both only counted and logged, the reward says what they were worth. `metrics`:
    numbers for the logs (an episode keeps each name's last value; a step logs the mean over its
    episodes as env/NAME, 0 for an episode that reported none)."""

    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (a fresh object per episode: it may keep state between steps)."""

    def reset(self, seed: int) -> Reset:
        """Start an episode; `seed` picks it (episodes of one GRPO group share a seed)."""

    def step(self, message: dict, token_ids: list[int]) -> Step:
        """React to the assistant's turn (an OpenAI chat message dict, and its sampled ids)."""
