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
