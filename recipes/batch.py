"""Turn rollouts into padded training tensors, and score completions with the trainer's model."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, T] index of the logits that predict completion token t
    targets: torch.Tensor  # [B, T] completion token ids (0 where padded)
    mask: torch.Tensor  # [B, T] 1 on real completion tokens (an episode's: on the policy's turns only)
    engine_logp: torch.Tensor  # [B, T] the engine's sampled-token logprobs (behaviour policy)

    def to(self, device) -> "Batch":
        return Batch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def select(self, idx: torch.Tensor) -> "Batch":
        return Batch(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))


def build_batch(rollouts: list, pad_id: int) -> Batch:
    B = len(rollouts)
    L = max(len(r.prompt_token_ids) + len(r.token_ids) for r in rollouts)
    T = max(max(len(r.token_ids) for r in rollouts), 1)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    engine_logp = torch.zeros(B, T)
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_token_ids), len(r.token_ids)
        input_ids[i, : p + c] = torch.tensor(r.prompt_token_ids + r.token_ids)
        attention_mask[i, : p + c] = 1
        positions[i] = torch.arange(p - 1, p - 1 + T).clamp(max=L - 1)
        targets[i, :c] = torch.tensor(r.token_ids, dtype=torch.long)
        # an episode (recipes/episodes.py): only the policy's own tokens train, none of one that failed
        policy = getattr(r, "policy_mask", None)
        mask[i, :c] = 1 if policy is None else torch.tensor(policy, dtype=torch.float) * float(r.trainable)
        engine_logp[i, :c] = torch.tensor(r.logprobs)
    return Batch(input_ids, attention_mask, positions, targets, mask, engine_logp)


def completion_logits(model, batch: Batch, temperature: float = 1.0):
    """Logits [B, T, V] (divided by the sampling temperature) at the positions that predict each
    completion token, and the value estimates there [B, T] when the model has a value head."""
    # Only the positions from the earliest completion on go through the LM head: a prompt's
    # logits ([B, prompt, V], most of the batch with a real vocabulary) are never needed.
    first = int(batch.positions[:, 0].min())
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                logits_to_keep=batch.input_ids.shape[1] - first)
    idx = batch.positions - first
    logits = out.logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1])).float()
    if temperature != 1.0:
        logits = logits / temperature
    values = getattr(out, "value_estimates", None)  # set by PolicyWithValue, over every position
    return logits, (values.gather(1, batch.positions) if values is not None else None)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
