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


# rope types beyond each tiny family's own, as variants of a family's directory: Qwen3 with YaRN (its
# long-context setting; an original context of 64 positions, so that tests' sequences cross the scaled
# wavelengths) and Llama with dynamic NTK (the default table while no position passes 4096)
ROPE_VARIANTS = {
    "qwen3_yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                   {"max_position_embeddings": 256}),
    "llama_dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}, {}),
}


@pytest.fixture(scope="session")
def rope_dirs(model_dirs, tmp_path_factory):
    """{variant: model directory} for ROPE_VARIANTS (the family's weights, its config's rope replaced)."""
    import json

    from tests.engine.helpers import model_variant

    root, dirs = tmp_path_factory.mktemp("rope_variants"), {}
    for name, (family, rope, extra) in ROPE_VARIANTS.items():
        with open(f"{model_dirs[family]}/config.json") as f:
            theta = json.load(f)["rope_parameters"]["rope_theta"]
        dirs[name] = model_variant(model_dirs[family], root / name, **extra,
                                   rope_parameters={"rope_theta": theta, **rope})
    return dirs


@pytest.fixture(scope="session")
def rope_hf_models(rope_dirs):
    import torch
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for name, d in rope_dirs.items()}
