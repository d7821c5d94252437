"""recipes/routing_replay.py: a transformers 5 MoE trainer routes every token the engine routed to the
engine's experts (its gate weights from its own logits, gradients included); the mismatch share it
removes; refusals by name."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, EngineConfig, SamplingParams
from recipes.routing_replay import align, own_routing, replay, routers, routing_mismatch
from tests.engine.helpers import random_prompts


@pytest.fixture(scope="module")
def trainer(moe_dirs):
    return AutoModelForCausalLM.from_pretrained(moe_dirs["qwen3_moe"], dtype=torch.float32)


def test_replay_routes_every_token_as_the_bf16_engine_did(moe_dirs, trainer):
    llm = LLM(EngineConfig(model=moe_dirs["qwen3_moe"], dtype="bfloat16", max_model_len=256))
    prompts = random_prompts(6, 8, 30, 2000, seed=9)
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, seed=1, return_routed_experts=True),
                        use_tqdm=False)
    shares = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        seq = torch.tensor([p + c.token_ids])
        ids, mask = align(c.routed_experts, 0, seq.shape[1])
        assert mask.sum() == seq.shape[1] - 1  # every position but the last sampled token's
        shares.append(routing_mismatch(own_routing(trainer, seq)[0], ids, mask))
        with replay(trainer, ids[None], mask[None]) as used:
            logits = trainer(seq).logits
        chosen = torch.stack(used, dim=1)  # [T, layers, k]
        assert torch.equal(chosen[mask], ids[mask])  # every routed token, every layer: the engine's experts
        assert torch.isfinite(logits).all()
    # fp32 trainer against a bf16 engine: some decisions differ without replay (what it removes)
    assert 0 < np.mean(shares) < 0.9, shares


def test_replayed_weights_are_the_routers_own_and_carry_gradients(trainer):
    """Routes the router would not choose: its softmax at those experts, renormalised; the loss's
    gradient reaches the router's weight through them."""
    seq = torch.tensor([[5, 6, 7, 8, 9]])
    own = own_routing(trainer, seq)[0]
    forced = (own + 1) % trainer.config.num_experts  # other experts, still distinct per token
    mask = torch.ones(5, dtype=torch.bool)
    trainer.zero_grad()
    with replay(trainer, forced[None], mask[None]) as used:
        trainer(seq).logits.sum().backward()
    assert torch.equal(torch.stack(used, 1), forced)
    gate = routers(trainer)[0]
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
    with torch.no_grad():
        logits, weights, ids = gate(torch.randn(3, trainer.config.hidden_size))
    probs = torch.softmax(logits, -1).gather(-1, ids)
    assert torch.allclose(weights, probs / probs.sum(-1, keepdim=True))  # what _replayed recomputes
    trainer.zero_grad()


def test_refusals_name_what_is_wrong(trainer, hf_models):
    with pytest.raises(ValueError, match="no MoE routers"):
        with replay(hf_models["qwen2"], torch.zeros(1, 3, 4, 2, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)):
            pass
    with pytest.raises(ValueError, match="3 layers of routes for a model of 4"):
        with replay(trainer, torch.zeros(1, 3, 3, 2, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)):
            pass
    with pytest.raises(ValueError, match="routes for 3 tokens, a forward of 4"):
        with replay(trainer, torch.zeros(1, 3, 4, 2, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)):
            trainer(torch.tensor([[1, 2, 3, 4]]))


def test_align_and_mismatch_share():
    routed = np.arange(2 * 4 * 2, dtype=np.uint8).reshape(2, 4, 2)
    ids, mask = align(routed, 3, 6)
    assert mask.tolist() == [False, False, False, True, True, False] and torch.equal(ids[3], torch.tensor(routed[0]).long())
    own = ids.clone()
    own[4, 2] = own[4, 2].flip(-1)  # the same set in another order: no mismatch
    assert routing_mismatch(own, ids, mask) == 0.0
    own[4, 3, 0] = 99
    assert routing_mismatch(own, ids, mask) == 0.5
