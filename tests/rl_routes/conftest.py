import pytest

from tests.rollout.sidecar import Sidecar


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    """A loopback sidecar with vLLM's RL routes on its HTTP front, one per test module."""
    side = Sidecar(qwen2_dir, "--http-port", "0", "--weight-transfer-routes", token="")
    yield side
    side.stop()
