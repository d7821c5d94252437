"""A step's episodes -> the rewards GRPO trains on and the metrics the agent recipe logs."""

from __future__ import annotations

import torch


def episode_rewards(episodes: list, group_size: int) -> torch.Tensor:
    """Each episode's reward; one that failed (its environment raised) takes its group's mean over
    the others, so it moves neither the baseline nor (masked out of the loss) the policy."""
    rewards = []
    for g in range(0, len(episodes), group_size):
        group = episodes[g:g + group_size]
        good = [e.reward for e in group if e.error is None]
        fill = sum(good) / len(good) if good else 0.0
        rewards += [e.reward if e.error is None else fill for e in group]
    return torch.tensor(rewards, dtype=torch.float32)


def episode_metrics(episodes: list) -> dict:
    """Turns, tool calls and their failures, errors, staleness restarts and tokens, per episode; the
    environments' own numbers (Step.metrics) as env/NAME."""
    n = len(episodes)
    calls = sum(e.tool_calls for e in episodes)
    errors = sum(e.tool_errors for e in episodes)
    policy = [sum(e.policy_mask) for e in episodes]
    return {
        "episodes/turns": sum(e.turns for e in episodes) / n,
        "episodes/tool_calls": calls / n,
        "episodes/tool_errors": errors / n,
        "episodes/well_formed_calls": (calls - errors) / calls if calls else 0.0,
        # episodes with at least one call that ran (the share the calculator's learning shows)
        "episodes/called_well": sum(e.tool_calls > e.tool_errors for e in episodes) / n,
        "episodes/errors": sum(e.error is not None for e in episodes),
        "episodes/turn_errors": sum(e.error_in == "turn" for e in episodes),  # requests the sidecar refused
        "episodes/done": sum(e.end == "done" for e in episodes) / n,
        "episodes/context_cut": sum(e.end == "context" for e in episodes) / n,
        "episodes/stale_restarts": sum(e.restarts for e in episodes),
        "episodes/stale": sum(e.stale for e in episodes),
        # episodes whose policy tokens came from more than one weight version (a push landed mid-episode)
        "episodes/spanning_push": sum(len({v for v, m in zip(e.weight_versions, e.policy_mask) if m}) > 1
                                      for e in episodes),
        "tokens/policy": sum(policy) / n,
        "tokens/context": sum(len(e.token_ids) for e in episodes) / n - sum(policy) / n,
        **{f"env/{k}": sum(e.metrics.get(k, 0.0) for e in episodes) / n
           for k in sorted({k for e in episodes for k in e.metrics})},
    }


def transcript_rows(episodes: list, rewards: torch.Tensor, groups: int, group_size: int) -> list[dict]:
    """The first `groups` groups' conversations, for completions.jsonl."""
    return [{"messages": [{k: v for k, v in m.items() if k != "token_ids"} for m in e.messages],
             "reward": r, "turns": e.turns, "end": e.end, "error": e.error}
            for e, r in zip(episodes[:groups * group_size], rewards.tolist())]
