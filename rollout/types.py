"""What the trainer gets back: whole rollouts, one per sample, with per-token versions."""

from __future__ import annotations

import msgspec


class Rollout(msgspec.Struct, array_like=True):
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # one per token, from the distribution it was sampled from
    text: str
    finish_reason: str  # "stop" | "length"; an abort is resubmitted, never returned
    weight_versions: list[int]  # the weight version each token was sampled under
    index: int = 0  # which of the group's n samples
    stop_reason: int | str | None = None
    # True when it is still more than max_staleness versions old after the sidecar regenerated it
    # max_stale_restarts times (pushes came faster than it could be generated)
    stale: bool = False

    @property
    def start_version(self) -> int:
        return self.weight_versions[0] if self.weight_versions else -1
