import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny Qwen2 and Llama model directories, built offline once per test session."""
    from recipes.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(build_tiny_model(root / arch, "tiny", arch)) for arch in ("qwen2", "llama")}


@pytest.fixture(scope="session")
def qwen2_dir(model_dirs):
    return model_dirs["qwen2"]


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    import torch
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for arch, d in model_dirs.items()
    }
