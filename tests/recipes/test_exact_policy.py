"""`--on-policy exact` (recipes/exact_policy.py): the trainer's logprobs are the engine's bits, with
torch's gradients; a GRPO run through its own sidecar logs a logprob difference of exactly 0 where
the plain trainer's is not, with LoRA too."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, EngineConfig, SamplingParams
from engine.exact_logprobs import ExactLogprobs
from recipes import grpo
from recipes import losses as L
from recipes.batch import build_batch, completion_logits, token_logprobs
from recipes.exact_policy import padded, straight_through
from rollout.common.types import Rollout
from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance

pytestmark = pytest.mark.timeout(600)


def test_straight_through_has_the_exact_bits_and_the_references_gradient():
    ref = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    exact = torch.tensor([-1.0000001, -1.9999999, -0.5000001])
    out = straight_through(ref * 2, exact)
    assert torch.equal(out.detach(), exact)
    (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(ref.grad, torch.tensor([2.0, 4.0, 6.0]))
    with pytest.raises(ValueError, match="differ in shape"):
        straight_through(ref, exact[:2])


def _rollouts(model_dir):
    llm = LLM(EngineConfig(model=model_dir, dtype="float32", max_model_len=256, num_threads=2))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    params = [SamplingParams(n=2, max_tokens=rng.randrange(4, 24), seed=i, ignore_eos=True) for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [Rollout(prompt_token_ids=o.prompt_token_ids, token_ids=c.token_ids, logprobs=c.logprobs, text="",
                    finish_reason="length", weight_versions=[0] * len(c.token_ids))
            for o in outs for c in o.outputs]


def test_the_exact_loss_has_torchs_gradient_and_the_engines_values(qwen2_dir):
    """At the rollout's weights the clipped loss's ratio is 1 either way: the exact mode's gradient is
    the plain trainer's bit for bit, and its logprobs differ from the trainer's by fp32 rounding alone."""
    rollouts = _rollouts(qwen2_dir)
    policy = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    batch = build_batch(rollouts, 0)
    scorer = ExactLogprobs(EngineConfig(model=qwen2_dir, dtype="float32", max_model_len=256, num_threads=2))
    exact = padded(scorer.logprobs([r.prompt_token_ids for r in rollouts], [r.token_ids for r in rollouts]),
                   batch.engine_logp.shape[1])
    assert torch.equal(exact, batch.engine_logp)
    adv = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in ("plain", "exact"):
        policy.zero_grad()
        ref = token_logprobs(completion_logits(policy, batch)[0], batch.targets)
        logp = ref if mode == "plain" else straight_through(ref, exact)
        pg, _ = L.clipped_policy_loss(logp, logp.detach(), adv, batch.mask)
        L.aggregate(pg, batch.mask, "token-mean", 0).backward()
        grads.append([p.grad.clone() for p in policy.parameters()])
        if mode == "exact":
            assert torch.equal(logp.detach(), exact)
            ids = rollouts[0].prompt_token_ids + rollouts[0].token_ids
            tol = fp32_logprob_tolerance(policy.config, activation_magnitude(policy, ids))
            assert ((ref.detach() - exact).abs() * batch.mask).max() <= tol
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _max_difference(out_dir):
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["sampling/sampling_logp_difference/max"] for r in rows]


def test_grpo_on_policy_exact_logs_no_difference_where_the_plain_trainer_does(qwen2_dir, tmp_path):
    """A bf16 sidecar, LoRA pushed as an adapter (merged by the sidecar): the plain fp32 trainer's logprobs
    differ from the engine's, the exact mode's do not, at any step."""
    common = ["--model", qwen2_dir, "--max-steps", "2", "--prompts-per-step", "4", "--group-size", "4",
              "--sidecar-dtype", "bfloat16", "--lora-r", "4", "--lr", "1e-2", "--log-completions", "0"]
    grpo.main([*common, "--output-dir", str(tmp_path / "plain")])
    grpo.main([*common, "--output-dir", str(tmp_path / "exact"), "--on-policy", "exact"])
    assert all(d > 0 for d in _max_difference(tmp_path / "plain"))
    assert _max_difference(tmp_path / "exact") == [0.0, 0.0]


def test_on_policy_exact_refuses_what_it_cannot_match(qwen2_dir, tmp_path):
    for flags, said in ((["--engine", "vllm"], "not vLLM's"), (["--device", "cuda"], "CPU trainer and sidecar")):
        with pytest.raises(ValueError, match=said):
            grpo.main(["--model", qwen2_dir, "--on-policy", "exact", "--output-dir", str(tmp_path), *flags])
