"""engine/models/gemma_model.py: Gemma 3's text model on the engine's own modules holds HF's parameters
under HF's names and its two rope tables, reads the Hub's older config fields as transformers does, and
gives HF's greedy tokens in fp32 (windows of 32 keys cut on three layers of four) on each attention
path, fresh and after a prefix-cache hit, with logprobs within fp32's rounding of HF's full forward.
What it does not build (soft-capped logits) is loaded by transformers. Pushes into it:
tests/weight_sync/test_family_push.py."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import native_kernels
from engine.models import gemma_model
from tests.engine.helpers import (
    assert_greedy_is_hfs_fresh_and_after_a_prefix_hit, assert_logprobs_are_hfs, hf_greedy, model_variant,
    random_prompts,
)


@pytest.fixture(scope="module")
def gemma_dir(tiny_dirs):
    return tiny_dirs["gemma3"]


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir):
    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


@pytest.fixture
def restore_kernels():
    yield
    native_kernels.reset()


def test_the_parameters_and_rope_tables_are_hfs(gemma_dir, hf_gemma):
    ours = gemma_model.load(gemma_dir, torch.float32)
    mine, hf = dict(ours.named_parameters()), dict(hf_gemma.named_parameters())
    assert list(mine) == list(hf)
    for name, p in hf.items():
        assert torch.equal(mine[name], p), name
    assert any(n.endswith("pre_feedforward_layernorm.weight") for n in mine)
    for kind in ("sliding_attention", "full_attention"):
        assert torch.equal(getattr(ours.model.rotary_emb, f"{kind}_inv_freq"),
                           getattr(hf_gemma.model.rotary_emb, f"{kind}_inv_freq")), kind
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers]
    assert windows == [layer.self_attn.sliding_window for layer in hf_gemma.model.layers] == [32, 32, 32, None]


def test_the_hubs_older_config_fields_read_as_transformers_reads_them(gemma_dir, tmp_path):
    """Gemma 3 1B's config.json as published: `sliding_window_pattern`, `rope_theta` (here with a linear
    `rope_scaling`, the larger models' setting) and `rope_local_base_freq`, no `layer_types`."""
    from transformers import AutoConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    old = {"layer_types": None, "rope_parameters": None, "sliding_window_pattern": 3, "rope_theta": 500000.0,
           "rope_local_base_freq": 20000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    path = model_variant(gemma_dir, tmp_path / "old", **old)
    raw = {k: v for k, v in json.loads((tmp_path / "old" / "config.json").read_text()).items() if v is not None}
    (tmp_path / "old" / "config.json").write_text(json.dumps(raw))
    hf_cfg = AutoConfig.from_pretrained(path)
    ours = gemma_model.read_config(path)
    assert ours.layer_types == hf_cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention",
                                                      "sliding_attention"]
    model = gemma_model.load(path, torch.float32)
    hf_rope = Gemma3RotaryEmbedding(hf_cfg)
    for kind in ("sliding_attention", "full_attention"):
        assert torch.equal(getattr(model.model.rotary_emb, f"{kind}_inv_freq"), getattr(hf_rope, f"{kind}_inv_freq"))
        assert model.model.rotary_emb.scaling[kind] == getattr(hf_rope, f"{kind}_attention_scaling")


PATHS = {"c kernel": {}, "torch masks": {"ROLLOUT_NATIVE_KERNELS": "0"}}


@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_tokens_are_hfs_in_fp32_fresh_and_after_a_prefix_hit(path, gemma_dir, hf_gemma, monkeypatch,
                                                                     restore_kernels):
    for k, v in PATHS[path].items():
        monkeypatch.setenv(k, v)
    native_kernels.reset()
    llm = LLM(EngineConfig(model=gemma_dir, max_num_seqs=8, max_model_len=128, block_size=8))
    assert type(llm.core.worker.model) is gemma_model.CausalLM
    assert llm.core.runner.native_decode == (path == "c kernel")
    assert_greedy_is_hfs_fresh_and_after_a_prefix_hit(llm, hf_gemma, random_prompts(4, 24, 50, 2000, seed=29))


def test_logprobs_are_a_full_hf_forwards_within_fp32_rounding(gemma_dir, hf_gemma):
    llm = LLM(EngineConfig(model=gemma_dir, max_num_seqs=8, max_model_len=128))
    assert_logprobs_are_hfs(llm, hf_gemma, random_prompts(3, 30, 50, 2000, seed=31))


def test_the_bf16_engine_runs_on_its_own_layers(gemma_dir, hf_gemma):
    """bf16 rounds differently from HF's bf16 forward (our kernels' sums): its first greedy tokens agree."""
    llm = LLM(EngineConfig(model=gemma_dir, dtype="bfloat16", max_num_seqs=8, max_model_len=128))
    assert type(llm.core.worker.model) is gemma_model.CausalLM
    prompts = random_prompts(4, 24, 50, 2000, seed=37)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    hf = hf_gemma.to(torch.bfloat16)
    try:
        agree = sum(o.outputs[0].token_ids[0] == hf_greedy(hf, p, 1)[0] for p, o in zip(prompts, outs))
    finally:
        hf_gemma.float()
    assert agree >= 3


def test_soft_capped_logits_are_left_to_transformers(gemma_dir, tmp_path):
    capped = model_variant(gemma_dir, tmp_path / "capped", final_logit_softcapping=30.0)
    assert gemma_model.unsupported(capped) == "soft-capped final logits"
    llm = LLM(EngineConfig(model=capped, max_num_seqs=4, max_model_len=128))
    assert type(llm.core.worker.model).__module__.startswith("transformers.")
    hf = AutoModelForCausalLM.from_pretrained(capped, dtype=torch.float32).eval()
    prompt = random_prompts(1, 40, 40, 2000, seed=41)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8, ignore_eos=True)


def test_gemma2s_soft_capped_attention_is_refused_not_ignored(gemma_dir, tmp_path):
    """Gemma 2 runs on transformers' layers with the paged attention plugged in, which does not cap
    scores: the engine refuses it by name rather than serve another model's tokens."""
    import shutil

    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma2", vocab_size=2048, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  sliding_window=16)
    assert config.attn_logit_softcapping is not None
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{gemma_dir}/{name}", tmp_path / "gemma2" / name)
    llm = LLM(EngineConfig(model=str(tmp_path / "gemma2"), max_model_len=128))
    with pytest.raises(NotImplementedError, match="'softcap' .*Gemma2Attention"):
        llm.generate([[5, 6, 7] * 8], SamplingParams(max_tokens=4), use_tqdm=False)
