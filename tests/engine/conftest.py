"""The AsyncEngine tests' engine: the tiny model with a test RPC extension, one per module (a
module may define its own `cfg` / `engine` instead)."""

import pytest

from engine import AsyncEngine, EngineConfig
from tests.engine.async_helpers import EXT


@pytest.fixture(scope="module")
def cfg(qwen2_dir):
    return EngineConfig(model=qwen2_dir, max_num_seqs=64, max_model_len=512, worker_extension_cls=EXT)


@pytest.fixture(scope="module")
def engine(cfg, loop):  # needs the loop: torn down after the engine
    eng = AsyncEngine(cfg)
    yield eng
    eng.shutdown()


# variants of a tiny family's directory (its weights, config fields written over): rope types beyond
# each family's own, Qwen3 with YaRN (its long-context setting; an original context of 64 positions, so
# that tests' sequences cross the scaled wavelengths) and Llama with dynamic NTK (the default table while
# no position passes 4096); sliding windows shorter than tests' sequences, on every layer (Mistral's
# shape: Llama's layers and names), on the layers `layer_types` marks (Qwen2) and from
# `max_window_layers` up (Qwen3 without `layer_types`), and on a mixture of experts' every layer (Mixtral)
VARIANTS = {
    "qwen3_yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                   {"max_position_embeddings": 256}),
    "llama_dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}, {}),
    "mistral_window": ("llama", None, {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                       "sliding_window": 16}),
    "qwen2_window": ("qwen2", None, {"use_sliding_window": True, "sliding_window": 12,
                                     "layer_types": ["full_attention", "sliding_attention"] * 2}),
    "qwen3_window": ("qwen3", None, {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 2,
                                     "layer_types": None}),
    "mixtral_window": ("mixtral", None, {"sliding_window": 16}),
}


@pytest.fixture(scope="session")
def variant_dirs(tiny_dirs, tmp_path_factory):
    """{variant: model directory} for VARIANTS."""
    import json

    from tests.engine.helpers import model_variant

    root, dirs = tmp_path_factory.mktemp("config_variants"), {}
    for name, (family, rope, extra) in VARIANTS.items():
        if rope is not None:
            with open(f"{tiny_dirs[family]}/config.json") as f:
                extra = {**extra, "rope_parameters": {"rope_theta": json.load(f)["rope_parameters"]["rope_theta"],
                                                      **rope}}
        dirs[name] = model_variant(tiny_dirs[family], root / name, **extra)
    return dirs


@pytest.fixture(scope="session")
def variant_hf_models(variant_dirs):
    import torch
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            for name, d in variant_dirs.items()}
