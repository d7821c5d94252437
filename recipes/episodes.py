"""Run whole episodes against the sidecar: an environment (recipes/envs) and a source of assistant
turns (recipes/turns.py), many episodes in flight at once on one event loop.

An episode is stitched as the trainer will read it: the first turn's prompt, then every token after
it in order: the policy's turns (trained on, with the engine's logprob and weight version of each
token) and what the chat template and the environment put between them (context: masked out of the
loss). Each turn's prompt must extend the episode so far token for token (the sidecar splices earlier
turns in as sampled); anything else raises `StitchError`, as it would mean training on a sequence
the policy never saw.

Staleness across turns: an episode whose first token is more than `max_staleness` versions behind
the newest pushed version when a turn starts is played again from its start (at most
`max_stale_restarts` times, then kept and marked `stale`), as the rollout manager does for one
request. An environment that raises ends its episode, and so does a turn's request that the sidecar
refuses or fails (recipes.turns.TurnError: an HTTP error status, the sidecar's refusal): the error
is logged and kept in `error` (`error_in`: "environment" or "turn"), and the episode is left out of
the loss.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from recipes.turns import TurnError, history_message

log = logging.getLogger("recipes.episodes")


class StitchError(RuntimeError):
    """A turn's prompt does not extend the episode so far token for token."""


@dataclass
class Settings:
    max_turns: int = 3
    max_tokens: int = 16
    temperature: float = 1.0
    max_context: int = 1024  # the sidecar's --max-model-len: no turn starts that could not fit
    max_staleness: int | None = None
    max_stale_restarts: int = 3
    newest_version: Callable[[], int] = lambda: 0  # the version the trainer pushed last


@dataclass
class Episode:
    prompt_token_ids: list[int] = field(default_factory=list)  # the first turn's prompt
    token_ids: list[int] = field(default_factory=list)  # everything after it: policy turns and context
    policy_mask: list[int] = field(default_factory=list)  # 1 on the policy's own tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 on context
    weight_versions: list[int] = field(default_factory=list)  # per token, -1 on context
    messages: list[dict] = field(default_factory=list)  # the conversation, for logs
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    end: str = "max_turns"  # "done" | "max_turns" | "context" | "error"
    error: str | None = None
    error_in: str | None = None  # "environment" | "turn" (the sidecar refused or failed a request)
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's Step.metrics, last values
    stale: bool = False
    restarts: int = 0

    @property
    def trainable(self) -> bool:
        return self.error is None and any(self.policy_mask)

    @property
    def start_version(self) -> int | None:
        return next((v for v, m in zip(self.weight_versions, self.policy_mask) if m), None)

    def add_turn(self, turn) -> None:
        """The turn's prompt (checked to extend the episode) and its sampled tokens."""
        if not self.prompt_token_ids:
            self.prompt_token_ids = list(turn.prompt_token_ids)
        else:
            so_far = self.prompt_token_ids + self.token_ids
            if turn.prompt_token_ids[:len(so_far)] != so_far:
                raise StitchError(f"turn {self.turns}'s prompt does not extend the episode's {len(so_far)} tokens")
            gap = turn.prompt_token_ids[len(so_far):]
            self._extend(gap, [0] * len(gap), [0.0] * len(gap), [-1] * len(gap))
        n = len(turn.token_ids)
        self._extend(turn.token_ids, [1] * n, turn.logprobs, turn.weight_versions)
        self.turns += 1

    def _extend(self, ids, mask, logprobs, versions) -> None:
        if not len(ids) == len(mask) == len(logprobs) == len(versions):
            raise StitchError(f"a turn of {len(ids)} tokens came with {len(logprobs)} logprobs, {len(versions)} versions")
        self.token_ids += ids
        self.policy_mask += mask
        self.logprobs += list(logprobs)
        self.weight_versions += list(versions)


async def run_episode(turns, make_env, seed: int, request_seed: int, s: Settings) -> Episode:
    """One episode, played again from the start while it is too stale (see the module's docstring)."""
    restarts = 0
    while True:
        ep = await _play(turns, make_env(), seed, request_seed + restarts * s.max_turns, s)
        ep.restarts = restarts
        if ep.end != "stale":
            return ep
        if restarts == s.max_stale_restarts:
            ep.stale, ep.end = True, "max_turns"
            return ep
        restarts += 1


async def _play(turns, env, seed: int, request_seed: int, s: Settings) -> Episode:
    session = f"episode-{request_seed}"  # its turns stay on one sidecar, where their prefix is cached
    try:
        return await _turns(turns, env, seed, request_seed, s, session)
    finally:
        end = getattr(turns, "end_session", None)
        if end is not None:
            end(session)


async def _turns(turns, env, seed: int, request_seed: int, s: Settings, session: str) -> Episode:
    ep = Episode()
    try:
        first = env.reset(seed)
    except Exception as e:  # noqa: BLE001 - an environment's fault ends its episode, not the run
        return _failed(ep, "reset", e)
    messages, tools = list(first.messages), first.tools
    for t in range(s.max_turns):
        if t and len(ep.prompt_token_ids) + len(ep.token_ids) + s.max_tokens > s.max_context:
            ep.end = "context"
            break
        if t and s.max_staleness is not None and ep.start_version is not None \
                and s.newest_version() - ep.start_version > s.max_staleness:
            ep.end = "stale"
            break
        try:
            turn = await turns(messages, tools, s.max_tokens, s.temperature, request_seed + t, session)
        except TurnError as e:  # this request's fault (a refused prompt, a bad message), not the run's
            return _failed(ep, f"turn {t}", e, messages, "turn")
        ep.add_turn(turn)
        try:
            step = env.step(turn.message, turn.token_ids)
        except Exception as e:  # noqa: BLE001
            return _failed(ep, f"step {t}", e, messages + [turn.message])
        messages += [history_message(turn), *step.messages]
        ep.reward += step.reward
        ep.tool_calls += step.tool_calls
        ep.tool_errors += step.tool_errors
        ep.metrics.update(step.metrics)
        if step.done:
            ep.end = "done"
            break
    ep.messages = messages
    return ep


def _failed(ep: Episode, where: str, e: Exception, messages: list[dict] | None = None,
            error_in: str = "environment") -> Episode:
    if error_in == "turn":
        log.warning("the sidecar refused or failed the request of %s; the episode ends there: %s", where, e)
    else:
        log.warning("the environment raised in %s; the episode ends there: %s: %s", where, type(e).__name__, e,
                    exc_info=e)
    ep.error, ep.error_in, ep.end, ep.messages = f"{type(e).__name__}: {e}", error_in, "error", messages or []
    return ep


async def run_episodes(turns, make_env, seeds: list[int], request_seeds: list[int], s: Settings) -> list[Episode]:
    """Every episode at once (each turn is its own request: the sidecar batches them)."""
    return list(await asyncio.gather(*(run_episode(turns, make_env, seed, rs, s)
                                       for seed, rs in zip(seeds, request_seeds))))
