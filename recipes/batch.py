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
    # a mixture of experts' rollouts: the engine's experts of each input position [B, L, layers, k]
    # and which positions have one [B, L] (recipes/routing_replay.py); None otherwise
    routes: torch.Tensor | None = None
    route_mask: torch.Tensor | None = None
    replay: bool = False  # the forwards route by `routes` (--routing-replay)
    rollouts: list | None = None  # the rollouts themselves (a whole batch's; --on-policy exact scores them)

    def _map(self, fn) -> "Batch":
        return Batch(*(v if v is None or isinstance(v, (bool, list)) else fn(v)
                       for v in (getattr(self, f) for f in self.__dataclass_fields__)))

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device))

    def select(self, idx: torch.Tensor) -> "Batch":
        return self._map(lambda t: t[idx])


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
    return Batch(input_ids, attention_mask, positions, targets, mask, engine_logp, *_routes(rollouts, L))


def _routes(rollouts: list, length: int) -> tuple:
    """(routes [B, L, layers, k], mask [B, L]) of rollouts that carry their routed experts, else (None, None)."""
    from recipes.routing_replay import align

    arrays = [r.routed_experts_array() if hasattr(r, "routed_experts_array") else None for r in rollouts]
    if any(a is None for a in arrays):
        return None, None
    aligned = [align(a, 0, length) for a in arrays]
    return torch.stack([ids for ids, _ in aligned]), torch.stack([m for _, m in aligned])


def completion_logits(model, batch: Batch, temperature: float = 1.0):
    """Logits [B, T, V] (divided by the sampling temperature) at the positions that predict each
    completion token, and the value estimates there [B, T] when the model has a value head."""
    # Only the positions from the earliest completion on go through the LM head: a prompt's
    # logits ([B, prompt, V], most of the batch with a real vocabulary) are never needed.
    first = int(batch.positions[:, 0].min())
    with routed(model, batch):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                    logits_to_keep=batch.input_ids.shape[1] - first)
    idx = batch.positions - first
    logits = out.logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1])).float()
    if temperature != 1.0:
        logits = logits / temperature
    values = getattr(out, "value_estimates", None)  # set by PolicyWithValue, over every position
    return logits, (values.gather(1, batch.positions) if values is not None else None)


def routed(model, batch: Batch):
    """The context of a forward over `batch`: the engine's experts replayed (batch.replay), else none."""
    import contextlib

    from recipes.routing_replay import replay

    if batch.routes is None or not batch.replay:
        return contextlib.nullcontext()
    return replay(model, batch.routes, batch.route_mask)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
