"""weight_sync's layout holds (weight_sync/README.md, "Layout"): the ground (weight_sync.common)
imports neither half, the engine's half (weight_sync.engine_side) never imports the trainer's
(weight_sync.trainer), and an engine's core process that took a push loaded no module of the
trainer's half."""

import asyncio
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import AsyncEngine, EngineConfig
from tests.layout import imported_modules
from weight_sync import WeightSender
from weight_sync.engine_side.engines import engines_checksums
from weight_sync.trainer.local_engines import init_weight_sync, push_to_engines

pytestmark = pytest.mark.timeout(180)
ROOT = pathlib.Path(__file__).resolve().parents[2] / "weight_sync"
# each place, and the places it must not import (lazy imports and TYPE_CHECKING ones included)
FORBIDDEN = {"common": ("trainer", "engine_side", "vllm"), "engine_side": ("trainer",), "vllm": ("trainer",)}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every weight_sync module a file imports, wherever the import statement stands."""
    return [(line, m) for line, m in imported_modules(path) if m.startswith("weight_sync.")]


def test_the_ground_imports_neither_half_and_the_engine_half_never_the_trainer_half():
    wrong = []
    for place, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / place).glob("*.py")):
            for line, module in _imports(path):
                if module.split(".")[1] in forbidden:
                    wrong.append(f"weight_sync/{place}/{path.name}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_every_module_of_weight_sync_lives_in_one_of_its_places():
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("__")) == [
        "common", "engine_side", "trainer", "vllm"]


def test_an_engine_core_that_took_a_push_loaded_no_module_of_the_trainer_half(qwen2_dir, loop):
    cfg = EngineConfig(model=qwen2_dir, max_num_seqs=4, max_model_len=128, kv_cache_memory_gb=0.05,
                       worker_extension_cls="tests.weight_sync.modules_extension:ModulesExtension")
    engine = AsyncEngine(cfg)
    sender = WeightSender(timeout_s=20)
    trainer = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)

    async def push_then_ask():
        await init_weight_sync([engine], sender, timeout_s=20)
        await push_to_engines([engine], sender, trainer, version=1, timeout=60)
        assert await engines_checksums([engine]) == [sender.checksum(trainer)]
        return (await engine.collective_rpc("weight_sync_modules"))[0]

    try:
        loaded = loop.run_until_complete(asyncio.wait_for(push_then_ask(), 120))
    finally:
        sender.close_group()
        engine.shutdown()
    assert "weight_sync.engine_side.receive" in loaded  # the push went through the engine's half
    assert not [m for m in loaded if m.startswith("weight_sync.trainer")], loaded
