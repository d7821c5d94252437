"""engine/models/llama_model.py: the engine's own Llama-shaped models hold HF's parameters under HF's
names (Llama 3's scaled rope and Qwen3's q/k norms too), greedy tokens are HF's in fp32 for each
family, a core loads them without importing transformers, and what they do not cover is loaded by
transformers as before."""

import shutil
import subprocess
import sys

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.models import llama_model
from engine.models.model_loader import load_model
from tests.engine.helpers import (
    assert_greedy_is_hfs_fresh_and_after_a_prefix_hit, hf_greedy, model_variant, random_prompts,
)


FAMILIES = ["qwen2", "llama", "llama3", "qwen3"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_parameters_are_hfs_under_hfs_names(arch, model_dirs, hf_models):
    ours = llama_model.load(model_dirs[arch], torch.float32)
    theirs = hf_models[arch]
    mine, hf = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert list(mine) == list(hf)
    for name, p in hf.items():
        assert torch.equal(mine[name], p), name
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied, as HF ties it
    assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id
    # the rotary tables' frequencies: HF's for each rope type (llama3's scaled ones too), bit for bit
    assert torch.equal(ours.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_familys_greedy_tokens_are_hfs_in_fp32_on_the_python_forward(arch, model_dirs, hf_models, monkeypatch):
    """The layers' Python forward (the prefill's always; every step's here: the C decode loop off,
    tested on its own in test_native_layers.py) against HF's generate, token for token."""
    monkeypatch.setenv("ROLLOUT_NATIVE_LAYERS", "0")
    llm = LLM(EngineConfig(model=model_dirs[arch], max_num_seqs=8, max_model_len=128))
    assert type(llm.core.worker.model).__module__ == "engine.models.llama_model"
    prompts = random_prompts(4, 3, 40, 400, seed=7)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[arch], p, 16, ignore_eos=True)


@pytest.fixture(scope="module")
def phi3_dir(tiny_dirs):
    return tiny_dirs["phi3"]


@pytest.fixture(scope="module")
def hf_phi3(phi3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32).eval()


def test_phi3s_fused_projections_are_hfs_parameters_under_hfs_names(phi3_dir, hf_phi3):
    ours = llama_model.load(phi3_dir, torch.float32)
    mine, hf = dict(ours.named_parameters()), dict(hf_phi3.named_parameters())
    assert list(mine) == list(hf)  # HF's order too: o_proj before qkv_proj
    for name, p in hf.items():
        assert torch.equal(mine[name], p), name
    assert "model.layers.0.self_attn.qkv_proj.weight" in mine and "model.layers.0.mlp.gate_up_proj.weight" in mine
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight  # untied, as Phi-3's
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers]
    assert windows == [hf_phi3.config.sliding_window] * len(windows) == [32] * 4


@pytest.mark.parametrize("native", ["0", "1"])
def test_phi3s_greedy_tokens_are_hfs_in_fp32_past_its_window_and_after_a_prefix_hit(native, phi3_dir, hf_phi3,
                                                                                    monkeypatch):
    """Prompts of 40-60 tokens and 16 more: every layer attends to its last 32 keys only (HF's sliding mask),
    on the Python forward and in the C decode loop."""
    monkeypatch.setenv("ROLLOUT_NATIVE_LAYERS", native)
    llm = LLM(EngineConfig(model=phi3_dir, max_num_seqs=8, max_model_len=128))
    assert type(llm.core.worker.model).__module__ == "engine.models.llama_model"
    assert_greedy_is_hfs_fresh_and_after_a_prefix_hit(llm, hf_phi3, random_prompts(4, 40, 60, 2000, seed=13))


@pytest.fixture(scope="module")
def phi4_mini_dir(phi3_dir, tmp_path_factory):
    """Phi-4-mini's rotation at the tiny size: 3/4 of each head rotated (48 of 64 values), longrope's short
    and long factors (24 each) over an original context of 2048 (of 4096: an attention factor of
    sqrt(1 + ln 2 / ln 2048)), its head tied, no window."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = AutoConfig.from_pretrained(phi3_dir)
    pairs = int(64 * 0.75) // 2
    config = AutoConfig.for_model(
        "phi3", vocab_size=tiny.vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=768, max_position_embeddings=4096,
        original_max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.1,
        eos_token_id=tiny.eos_token_id, bos_token_id=tiny.bos_token_id, pad_token_id=tiny.pad_token_id,
        sliding_window=None, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
            "long_factor": [2.0 + 0.1 * i for i in range(pairs)]})
    out = tmp_path_factory.mktemp("phi4_mini")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{phi3_dir}/{name}", out / name)
    return str(out)


PATHS = {"c loop": {"ROLLOUT_NATIVE_LAYERS": "1"}, "python forward": {"ROLLOUT_NATIVE_LAYERS": "0"},
         "torch ops": {"ROLLOUT_NATIVE_KERNELS": "0"}}  # the last: fused_layers._rotate, no C glue


@pytest.mark.parametrize("path", list(PATHS))
def test_phi4_minis_partial_rotary_and_longrope_give_hfs_greedy_tokens(path, phi4_mini_dir, monkeypatch):
    """The rotation of the first 48 values of each head (the rest passed as they are) and longrope's short
    factors with its attention factor, in the C decode loop, the Python forward (its rotation in C glue)
    and on torch's ops alone, fp32, against HF."""
    from transformers import AutoModelForCausalLM

    from engine.kernels import native_kernels

    for k, v in PATHS[path].items():
        monkeypatch.setenv(k, v)
    native_kernels.reset()  # the kernels' switch is read once: read again now, and after the test
    hf = AutoModelForCausalLM.from_pretrained(phi4_mini_dir, dtype=torch.float32).eval()
    ours = llama_model.load(phi4_mini_dir, torch.float32)
    assert torch.equal(ours.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)  # 24 of them
    assert ours.model.rotary_emb.attention_scaling == hf.model.rotary_emb.attention_scaling > 1
    llm = LLM(EngineConfig(model=phi4_mini_dir, max_num_seqs=8, max_model_len=128))
    assert type(llm.core.worker.model).__module__ == "engine.models.llama_model"
    try:
        assert_greedy_is_hfs_fresh_and_after_a_prefix_hit(llm, hf, random_prompts(4, 30, 60, 2000, seed=17))
    finally:
        monkeypatch.undo()
        native_kernels.reset()


def test_longrope_past_its_original_context_takes_the_long_factors_everywhere_as_hf_past_it(phi4_mini_dir, tmp_path):
    """An engine whose max_model_len passes original_max_position_embeddings rotates every position by
    longrope's long factors (vLLM's choice: one table whatever the batch), on our layers: HF's own
    table once a sequence passes the original context, so prompts longer than it get HF's greedy tokens
    (C loop and Python forward, fp32), and different ones than the short factors give."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    short = model_variant(phi4_mini_dir, tmp_path / "short", original_max_position_embeddings=32,
                          max_position_embeddings=64)
    assert llama_model.unsupported(short, max_model_len=128) is None
    hf = AutoModelForCausalLM.from_pretrained(short, dtype=torch.float32).eval()
    long_freq, hf_scaling = ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu", seq_len=33)
    within = llama_model.load(short, torch.float32, max_model_len=32).model.rotary_emb
    past = llama_model.load(short, torch.float32, max_model_len=128).model.rotary_emb
    assert torch.equal(within.inv_freq, hf.model.rotary_emb.inv_freq)  # the short factors
    assert torch.equal(past.inv_freq, long_freq) and not torch.equal(past.inv_freq, within.inv_freq)
    assert past.attention_scaling == within.attention_scaling == hf_scaling > 1
    prompts = random_prompts(4, 34, 60, 2000, seed=19)  # each past the original context of 32
    want = [hf_greedy(hf, p, 16, ignore_eos=True) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ROLLOUT_NATIVE_LAYERS", native)
            llm = LLM(EngineConfig(model=short, max_num_seqs=8, max_model_len=128))
            assert type(llm.core.worker.model).__module__ == "engine.models.llama_model"
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    rope = hf.config.rope_parameters
    shorts = model_variant(short, tmp_path / "shorts", rope_parameters={**rope, "long_factor": rope["short_factor"]})
    hf_short = AutoModelForCausalLM.from_pretrained(shorts, dtype=torch.float32).eval()  # short factors past it too
    assert [hf_greedy(hf_short, p, 16, ignore_eos=True) for p in prompts] != want


@pytest.mark.parametrize("variant", ["qwen3_yarn", "llama_dynamic"])
def test_yarn_and_dynamic_ropes_run_on_our_layers_with_hfs_greedy_tokens(variant, variant_dirs, variant_hf_models,
                                                                          hf_models, monkeypatch):
    """The Python forward in fp32 (the C loops: test_native_layers.py) against HF's generate on the same
    directory; YaRN's tokens are not the family's default rope's (so the rope was felt), dynamic's are
    (no position passes max_position_embeddings)."""
    monkeypatch.setenv("ROLLOUT_NATIVE_LAYERS", "0")
    llm = LLM(EngineConfig(model=variant_dirs[variant], max_num_seqs=8, max_model_len=128))
    assert type(llm.core.worker.model).__module__ == "engine.models.llama_model"
    prompts = random_prompts(4, 3, 40, 400, seed=7)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    assert ours == [hf_greedy(variant_hf_models[variant], p, 16, ignore_eos=True) for p in prompts]
    family = hf_models[variant.split("_")[0]]
    plain = [hf_greedy(family, p, 16, ignore_eos=True) for p in prompts]
    assert (ours == plain) == (variant == "llama_dynamic")


def test_dynamic_rope_past_max_position_embeddings_keeps_transformers(variant_dirs):
    """Past max_position_embeddings HF's dynamic frequencies follow the batch's longest sequence: such
    an engine keeps transformers' modelling code, and says why."""
    assert llama_model.unsupported(variant_dirs["llama_dynamic"], max_model_len=4096) is None
    why = llama_model.unsupported(variant_dirs["llama_dynamic"], max_model_len=8192)
    assert why.startswith("rope type 'dynamic' past max_position_embeddings 4096 (max_model_len 8192")


ROPES = {  # name -> rope parameters beyond rope_type and rope_theta
    "default": {}, "linear": {"factor": 4.0}, "dynamic": {"factor": 2.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's long-context setting
    "yarn_mscale": {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                    "original_max_position_embeddings": 4096},  # DeepSeek's
    "yarn_attention": {"factor": 2.0, "attention_factor": 0.8, "beta_fast": 16.0, "truncate": False,
                       "original_max_position_embeddings": 4096},
    "longrope": {"short_factor": [1.0 + i / 32 for i in range(32)], "long_factor": [4.0 + i / 8 for i in range(32)],
                 "original_max_position_embeddings": 4096},  # Phi-3.5's and Phi-4-mini's, its short factors
}


@pytest.mark.parametrize("name", list(ROPES))
def test_the_rope_frequencies_are_transformers_own(name):
    """engine/models/rope_scaling.py against transformers' ROPE_INIT_FUNCTIONS on a Llama 3-sized head:
    the inverse frequencies bit for bit and the factor on cos and sin."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.models import rope_scaling

    rope = name.split("_")[0]
    params = {"rope_type": rope, "rope_theta": 500000.0, **ROPES[name]}
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=params,
                      max_position_embeddings=131072)
    ours, scaling = rope_scaling.inv_freq(rope_scaling.rope_parameters(cfg.to_dict()), 64, 131072)
    if rope == "default":
        theirs, their_scaling = _default_rope(cfg)
    else:
        theirs, their_scaling = ROPE_INIT_FUNCTIONS[rope](cfg, "cpu")
    assert torch.equal(ours, theirs) and scaling == their_scaling
    default = rope_scaling.default_inv_freq(500000.0, 64)
    # it did scale (dynamic's table is the default one until a position passes max_position_embeddings)
    assert torch.equal(ours, default) == (rope in ("default", "dynamic"))
    assert (scaling != 1.0) == (rope in ("yarn", "longrope"))


def _default_rope(cfg):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg, device="cpu")


def test_a_core_loads_its_model_without_transformers(qwen2_dir):
    code = ("import sys, torch\nfrom engine.config import EngineConfig\n"
            "from engine.models.model_loader import load_model\n"
            f"m = load_model(EngineConfig(model={qwen2_dir!r}), torch.device('cpu'))\n"
            "print(type(m).__module__, sorted(k for k in ('transformers', 'sympy', 'torch._dynamo') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["engine.models.llama_model", "[]"]


def test_what_it_does_not_cover_loads_with_transformers_and_still_matches_hf(qwen2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    scaled = model_variant(qwen2_dir, tmp_path / "scaled", max_position_embeddings=64,
                           rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    # dynamic's frequencies follow the batch's longest sequence past max_position_embeddings
    assert llama_model.unsupported(scaled, max_model_len=128).startswith(
        "rope type 'dynamic' past max_position_embeddings 64 (max_model_len 128")
    gelu = model_variant(qwen2_dir, tmp_path / "gelu", hidden_act="gelu")
    assert llama_model.unsupported(gelu) == "activation 'gelu'"
    llm = LLM(EngineConfig(model=scaled, max_model_len=128))
    assert type(llm.core.worker.model).__module__.startswith("transformers.")
    hf = AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32).eval()
    prompts = random_prompts(3, 4, 20, 2000, seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12, ignore_eos=True)


def test_a_checkpoint_whose_names_do_not_fit_is_left_to_transformers(qwen2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed"
    shutil.copytree(qwen2_dir, renamed)
    state = load_file(renamed / "model.safetensors")
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(state, renamed / "model.safetensors", metadata={"format": "pt"})
    assert llama_model.unsupported(str(renamed)) is None
    assert llama_model.load(str(renamed), torch.float32) is None
    model = load_model(EngineConfig(model=str(renamed)), torch.device("cpu"))
    assert type(model).__module__.startswith("transformers.")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rms_norm_is_hfs_arithmetic(dtype):
    """The fused norm the decoder layers run gives HF's LlamaRMSNorm's bits (widen, mean of squares,
    rsqrt, narrow, weight), on rows of every scale: it is the same arithmetic in one kernel. In bf16
    on the CPU the kernel is ours (native_glue.add_rms_norm) and sums the mean's squares in its own
    order: the mean differs from torch's by at most a few fp32 roundings (2 * gamma_576 relative), its
    rsqrt by half that, far below bf16's half-ulp, so a result differs only where the fp32 value lies
    that close to a bf16 rounding boundary, and then by one bf16 ulp (in the normalised value, then
    times the weight: at most 2 ulp of the output)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from engine.models.fused_layers import rms_norm

    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    x = (torch.randn(67, 576, generator=gen) * torch.logspace(-3, 3, 67)[:, None]).to(dtype)
    with torch.no_grad():
        got, want = rms_norm(norm, x), norm(x)
    if dtype != torch.bfloat16:
        assert torch.equal(got, want)
        return
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()
    assert (got != want).float().mean().item() < 0.01  # boundary cases only
