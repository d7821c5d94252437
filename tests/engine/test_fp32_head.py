"""The LM head in fp32 for a bf16 engine (EngineConfig.head_dtype, engine/kernels/fp32_head.py): fp32
logits that are the fp32 product of the bf16 weight, a copy that follows the weight, and logprobs
nearer an fp32 trainer's than the bf16 head's."""

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, EngineConfig, SamplingParams
from tests.engine.helpers import random_prompts


def _llm(model_dir, head_dtype):
    return LLM(EngineConfig(model=model_dir, dtype="bfloat16", head_dtype=head_dtype, max_num_seqs=8,
                            max_model_len=128, num_threads=2))


def _fp32_bound(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|fp32 sum in any order - exact| <= K * 2^-24 * sum |h| |w| per output (K terms, each partial
    sum rounded once): how far two fp32 GEMMs of the same operands may be apart, twice that."""
    k = h.shape[1]
    return 2 * k * 2.0 ** -24 * (h.double().abs() @ w.double().abs().t())


@pytest.fixture(scope="module")
def both(model_dirs):
    return _llm(model_dirs["qwen2"], "float32"), _llm(model_dirs["qwen2"], "auto")


def test_the_head_returns_fp32_logits_of_the_bf16_weight_and_follows_it(both):
    fp32, _ = both
    head = fp32.core.runner.model.get_output_embeddings()
    assert head.weight.dtype == torch.bfloat16  # the parameter pushes write stays the model's dtype
    h = torch.randn(5, head.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        got = head(h)
    want = F.linear(h.double(), head.weight.double())
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs() <= _fp32_bound(h, head.weight)).all()
    with torch.inference_mode():  # a write in place (a push's commit, a LoRA merge): the copy follows
        head.weight.mul_(2)
        moved = head(h)
        head.weight.div_(2)
    assert ((moved.double() - 2 * want).abs() <= 2 * _fp32_bound(h, head.weight)).all()


def test_the_engines_logprobs_come_from_the_fp32_head(both):
    """Greedy on both engines: the same tokens (a tiny model's margins are wide), and logprobs that
    differ: the fp32 head's logits were not rounded to bf16 before the softmax."""
    fp32, auto = both
    prompts = random_prompts(4, 8, 16, vocab=fp32.core.runner.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    outs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False) for llm in both]
    tokens = [[o.outputs[0].token_ids for o in out] for out in outs]
    assert tokens[0] == tokens[1]
    logprobs = [[lp for o in out for lp in o.outputs[0].logprobs] for out in outs]  # the sampled tokens'
    assert len(logprobs[0]) == 4 * 6
    assert logprobs[0] != logprobs[1]


def test_a_bad_head_dtype_is_refused(model_dirs):
    with pytest.raises(ValueError, match="head_dtype must be 'auto' or 'float32'"):
        EngineConfig(model=model_dirs["qwen2"], head_dtype="bfloat16")
