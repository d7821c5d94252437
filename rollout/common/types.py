"""What the trainer gets back: whole rollouts, one per sample, with per-token versions."""

from __future__ import annotations

import msgspec

from engine.messages import RoutedRows


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
    # SamplingParams.return_routed_experts: each position's experts per MoE layer (routing replay:
    # recipes/routing_replay.py), from routed_experts_prompt_start to the last token's input
    routed_experts: RoutedRows | None = None

    def routed_experts_array(self):
        """routed_experts as a numpy array [positions, layers, k] (None when not asked)."""
        import numpy as np

        r = self.routed_experts
        return None if r is None else np.frombuffer(r.data, dtype=r.dtype).reshape(-1, r.layers, r.k)

    @property
    def start_version(self) -> int:
        return self.weight_versions[0] if self.weight_versions else -1
