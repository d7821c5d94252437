"""Sliding-window attention (Mistral's every layer, Qwen2's and Qwen3's marked ones): each layer's window
as transformers sets it, and greedy tokens equal to HF's in fp32 with sequences well past the window,
on every attention path the engine has on a CPU (the C kernel under our layers' Python forward, the
torch path's masks, transformers' own layers with the paged attention), prompts fresh and on a
cached prefix. The C decode loop with windows: tests/engine/test_native_layers.py; the kernel against
float64 attention over each row's last keys: tests/engine/test_native_decode.py."""

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import native_kernels
from engine.models import llama_model
from tests.engine.helpers import assert_logprobs_are_hfs, hf_greedy, random_prompts

WINDOWED = ["mistral_window", "qwen2_window", "qwen3_window", "mixtral_window"]

# config fields over a 6-layer shape, and the families they apply to
CONFIGS = [
    ("mistral", {"sliding_window": 8}),
    ("mistral", {"sliding_window": None}),
    ("mixtral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 4}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"] * 3}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 5}),
    ("qwen2_moe", {"use_sliding_window": False, "sliding_window": 8}),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}),
    ("llama", {"sliding_window": 8}),
]


def _hf_windows(config, length: int = 20) -> list:
    """Each layer's window as transformers' forward applies it: the keys its mask leaves the last of
    `length` tokens (None: all of them), read by an attention function that records its masks."""
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.masking_utils import sdpa_mask

    masks = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        masks[module.layer_idx] = attention_mask
        return torch.zeros_like(query).transpose(1, 2), None

    AttentionInterface.register("window_probe", record)
    AttentionMaskInterface.register("window_probe", sdpa_mask)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="window_probe")
    with torch.no_grad():
        model(torch.arange(length)[None])
    seen = [masks[i] for i in range(config.num_hidden_layers)]
    # sdpa_mask leaves out a plain causal mask (SDPA's is_causal serves it)
    visible = [length if m is None else int(m[0, 0, -1].sum()) for m in seen]
    return [None if n == length else n for n in visible]


@pytest.mark.parametrize("family,fields", CONFIGS)
def test_each_layers_window_is_transformers(family, fields):
    """From the checkpoint's config.json as written (no `layer_types` unless given) and as transformers
    saves it (with them)."""
    from transformers import AutoConfig

    shape = dict(num_hidden_layers=6, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32)
    config = AutoConfig.for_model(family, **shape, **fields)
    expected = _hf_windows(config)
    for raw in ({"model_type": family, **shape, **fields}, config.to_dict()):
        cfg = SimpleNamespace(**raw)
        assert [llama_model.layer_window(cfg, i) for i in range(6)] == expected, raw
    if family != "llama" and fields.get("sliding_window") and fields.get("use_sliding_window", True):
        assert any(expected)  # the table tries windows that transformers applies


@pytest.fixture
def restore_kernels():
    yield
    native_kernels.reset()


PATHS = {  # how the engine attends: (environment, fuse_layers)
    "c kernel": ({"ROLLOUT_NATIVE_LAYERS": "0"}, True),
    "torch masks": ({"ROLLOUT_NATIVE_KERNELS": "0"}, True),
    "transformers' layers": ({}, False),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("variant", WINDOWED)
def test_greedy_tokens_past_the_window_are_hfs(variant, path, variant_dirs, variant_hf_models, monkeypatch,
                                               restore_kernels):
    """Prompts of 20-44 tokens and 16 new ones under windows of 12-20 keys: the prefill's fresh spans and
    every decode step cut by the window; then each prompt with 6 of its tokens appended, its prompt's
    blocks from the prefix cache (a span after a cached prefix, cut by the window too)."""
    env, fuse = PATHS[path]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    native_kernels.reset()
    llm = LLM(EngineConfig(model=variant_dirs[variant], max_num_seqs=8, max_model_len=128, block_size=8,
                           fuse_layers=fuse))
    own = type(llm.core.worker.model).__module__ == "engine.models.llama_model"
    assert own == fuse
    assert llm.core.runner.native_decode == (path != "torch masks")
    hf = variant_hf_models[variant]
    prompts = random_prompts(4, 20, 44, 400, seed=17)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    expected = [hf_greedy(hf, p, 16, ignore_eos=True) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    longer = [p + e[:6] for p, e in zip(prompts, expected)]
    outs = llm.generate(longer, greedy, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16, ignore_eos=True) for p in longer]


@pytest.mark.parametrize("variant", WINDOWED)
def test_logprobs_past_the_window_are_a_full_hf_forwards(variant, variant_dirs, variant_hf_models):
    """Against HF's forward over the whole sequence at once (no cache: its mask alone applies the
    window), within fp32's rounding bound; a window that did not cut would miss it by far more."""
    llm = LLM(EngineConfig(model=variant_dirs[variant], max_num_seqs=8, max_model_len=128))
    assert_logprobs_are_hfs(llm, variant_hf_models[variant], random_prompts(3, 24, 40, 400, seed=19))


@pytest.mark.parametrize("variant", ["mistral_window", "qwen2_window"])
def test_the_gpus_paths_forced_on_the_cpu_apply_the_window(variant, variant_dirs, variant_hf_models, monkeypatch,
                                                           restore_kernels):
    """A GPU's prefill (the spans padded into one call per layer, its mask per window) and its decode on the
    graphs' static buffers (run eagerly here: every step of the bookkeeping but the capture), with the torch
    attention: HF's greedy tokens, fresh and on a cached prefix."""
    from engine import step_inputs

    monkeypatch.setenv("ROLLOUT_NATIVE_KERNELS", "0")
    monkeypatch.setenv("ROLLOUT_DECODE_GRAPHS", "eager")
    native_kernels.reset()
    layouts = []
    monkeypatch.setattr(step_inputs, "padded_layout",
                        lambda *a, f=step_inputs.padded_layout: layouts.append(f(*a)) or layouts[-1])
    llm = LLM(EngineConfig(model=variant_dirs[variant], max_num_seqs=8, max_model_len=128, block_size=4,
                           prepack_linears=False))
    runner = llm.core.runner
    runner.padded_prefill = True
    assert runner.graph_mode == "eager"
    hf = variant_hf_models[variant]
    prompts = random_prompts(5, 18, 40, 400, seed=23)
    prompts += [p[: len(p) // 2 + 4] + [5, 6, 7] for p in prompts[:3]]  # after the first ones: cached prefixes
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    outs = llm.generate(prompts[:5], greedy, use_tqdm=False) + llm.generate(prompts[5:], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 14, ignore_eos=True) for p in prompts]
    assert any(x is not None for x in layouts) and runner.decode_graphs.captures > 0
    assert any(o.num_cached_tokens > 0 for o in outs[5:])
