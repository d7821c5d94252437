"""Environments written for other RL stacks, as `recipes.envs.Environment`s.

Two interfaces users already write text environments in, both Gymnasium's shape with text for the
action (neither package is imported: the adapters only call the methods):

- SkyRL-gym's `BaseTextEnv` (`skyrl_gym.envs.base_text_env`): `init(prompt) -> (prompt, metadata)`,
  `step(action: str) -> {"observations": [messages], "reward", "done", "metadata"}`, `close()`. Its
  observations are already OpenAI messages, so it maps one to one (`FromSkyRL`).
- Gymnasium's API with string observations and actions (TextArena, BALROG and most text games):
  `reset(seed=) -> (obs, info)`, `step(action) -> (obs, reward, terminated, truncated, info)`
  (`FromGymnasium`); each observation becomes a user message.

Both hand the environment the turn's raw text, decoded from the sampled ids (tool calls included:
such environments parse their own), not the parsed message. verifiers' multi-turn environments
need no adapter: they drive an OpenAI client themselves, so point theirs at the sidecar's HTTP
front (`rollout.serve --http-port`), and send each assistant turn back with its `token_ids`.
"""

from __future__ import annotations

from collections.abc import Callable

from recipes.envs.base import Reset, Step


def _raw_text(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


class FromSkyRL:
    """A SkyRL-gym text environment. `make(seed) -> (env, prompt)`: the environment of one sample and
    its prompt (a conversation), as SkyRL builds them from a dataset row (env_class, extras)."""

    def __init__(self, make: Callable[[int], tuple[object, list[dict]]], tokenizer, tools: list[dict] | None = None):
        self.make, self.tokenizer, self.tools = make, tokenizer, tools
        self.env = None

    def reset(self, seed: int) -> Reset:
        self.env, prompt = self.make(seed)
        messages, _ = self.env.init(prompt)
        return Reset([dict(m) for m in messages], self.tools)

    def step(self, message: dict, token_ids: list[int]) -> Step:
        out = self.env.step(_raw_text(self.tokenizer, token_ids))
        done = bool(out["done"])
        if done:
            self.env.close()
        return Step([dict(m) for m in out.get("observations") or []], float(out["reward"]), done)


class FromGymnasium:
    """A Gymnasium-style text environment (`reset(seed=)`, five-tuple `step(action)`); its string
    observations become user messages, after an optional `system` prompt."""

    def __init__(self, env, tokenizer, system: str | None = None, tools: list[dict] | None = None):
        self.env, self.tokenizer, self.system, self.tools = env, tokenizer, system, tools

    def reset(self, seed: int) -> Reset:
        obs, _ = self.env.reset(seed=seed)
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return Reset(messages + [{"role": "user", "content": str(obs)}], self.tools)

    def step(self, message: dict, token_ids: list[int]) -> Step:
        obs, reward, terminated, truncated, _ = self.env.step(_raw_text(self.tokenizer, token_ids))
        done = bool(terminated or truncated)
        return Step([] if done or obs is None else [{"role": "user", "content": str(obs)}], float(reward), done)
