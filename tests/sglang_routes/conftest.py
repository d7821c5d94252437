import pytest

from tests.rollout.sidecar import Sidecar


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    """A loopback sidecar of two engines with SGLang's RL routes on its HTTP front, one per test module."""
    side = Sidecar(qwen2_dir, "--http-port", "0", "--sglang-routes", "--num-engines", "2", token="")
    yield side
    side.stop()
