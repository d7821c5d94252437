"""completion_logits runs the LM head only from the earliest completion position on: the logits
and values it returns equal those of a full forward, gathered at each completion token."""

import torch
from transformers import AutoModelForCausalLM

from recipes.algorithms import PolicyWithValue
from recipes.batch import build_batch, completion_logits
from rollout.common.types import Rollout


def _rollout(prompt, completion):
    return Rollout(prompt, completion, [0.0] * len(completion), "", "length", [0] * len(completion), 0, None, False)


def test_only_completion_positions_go_through_the_head_and_nothing_changes(qwen2_dir):
    policy = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    with torch.no_grad():
        model = PolicyWithValue(policy)
        model.value_head.weight.normal_()  # values that differ from position to position
        batch = build_batch([_rollout([5, 6, 7, 8, 9, 10, 11], [12, 13]), _rollout([5, 6], [10, 11, 12, 13, 14]),
                             _rollout([7, 8, 9, 10], [3])], pad_id=0)
        logits, values = completion_logits(model, batch, temperature=0.7)
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        hidden = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                        output_hidden_states=True).hidden_states[-1]
        idx = batch.positions
        at = idx.unsqueeze(-1)
        want = full.logits.gather(1, at.expand(-1, -1, full.logits.shape[-1])) / 0.7
        # The body runs on the same full sequence either way; only the LM head sees fewer rows, and
        # a matmul kernel may block rows differently and so sum each dot product of length H in
        # another order: two fp32 orders differ by at most 2 * H * u * sum_i |h_i w_i| (u = 2^-24).
        h = hidden.gather(1, at.expand(-1, -1, hidden.shape[-1]))
        w = policy.get_output_embeddings().weight
        bound = 2 * h.shape[-1] * 2.0**-24 * (h.abs() @ w.abs().T) / 0.7
    assert ((logits - want).abs() <= bound).all()
    assert torch.equal(values, full.value_estimates.gather(1, idx))  # the value head sees every position
