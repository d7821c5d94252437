import asyncio
import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's processes (tests, sidecars, engine cores; two xdist workers) share few cores, and
# OpenMP threads that spin while they wait for work (libgomp's default) burn the CPU the others
# need: passive waiting took a two-file run on 2 cores from 220 s to 174 s. Set before anything
# imports torch (libgomp reads it once, when loaded); the sidecars and trainers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="module")
def loop():
    """One event loop per test module, for the tests that drive AsyncEngines with run_until_complete."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _run_tmp(tmp_path_factory):
    """A temporary directory of this whole run, which xdist's workers share (the basetemp's parent
    under xdist; pytest's retention removes it with the run's)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Every tiny model family the engine serves (engine.models.tiny_model.ARCHS), built offline
    once per run: by one process (a build is mostly its imports), the other xdist workers waiting
    on its locks and reusing its directories."""
    from engine.models.tiny_model import ARCHS, build_tiny_models

    root = _run_tmp(tmp_path_factory) / "tiny_models"
    return {arch: str(d) for arch, d in build_tiny_models({arch: root / arch for arch in ARCHS}).items()}


@pytest.fixture(scope="session")
def model_dirs(tiny_dirs):
    """Tiny Qwen2, Llama, Llama 3 (scaled rope) and Qwen3 (q/k norms) model directories."""
    return {arch: tiny_dirs[arch] for arch in ("qwen2", "llama", "llama3", "qwen3")}


@pytest.fixture(scope="session")
def qwen2_dir(model_dirs):
    return model_dirs["qwen2"]


@pytest.fixture(scope="session")
def qwen2_tokenizer(qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen2_dir)


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    import torch
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for arch, d in model_dirs.items()
    }


@pytest.fixture(scope="session")
def eos_model_dir(qwen2_dir, hf_models, tmp_path_factory):
    """The tiny Qwen2 with a second EOS id that greedy decoding actually emits (a random model
    rarely emits id 0), set the way real checkpoints do it: a list in generation_config.json."""
    import json
    import shutil

    from tests.engine.helpers import hf_greedy, random_prompts

    out = tmp_path_factory.mktemp("eos_model") / "qwen2"
    shutil.copytree(qwen2_dir, out)
    greedy = hf_greedy(hf_models["qwen2"], random_prompts(1, 10, 10, 2000, seed=99)[0], 12, ignore_eos=True)
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [0, greedy[8]]
    (out / "generation_config.json").write_text(json.dumps(gen_cfg))
    return str(out)


@pytest.fixture(scope="session")
def moe_dirs(tiny_dirs):
    """Tiny mixtures of experts of each family the engine runs on its own layers (8 experts, 2 a token)."""
    from engine.models.tiny_model import MOE_ARCHS

    return {arch: tiny_dirs[arch] for arch in MOE_ARCHS}


@pytest.fixture(scope="session")
def moe_dir(moe_dirs):
    """The tiny Qwen3-MoE (`--model tiny-moe`'s recipe)."""
    return moe_dirs["qwen3_moe"]
