"""vLLM's RL routes on a sidecar whose engine is vLLM's own (`--engine vllm`): vLLM's trainer code
pushes through them into vLLM's loaders (weight_sync/vllm_target.py), all or nothing as on ours."""

import subprocess
import sys

import httpx
import pytest

pytest.importorskip("vllm")

from rollout import RolloutClient  # noqa: E402
from tests.rl_routes.test_vllm_rl_routes import _train  # noqa: E402
from tests.rl_routes.vllm_trainer import perturbed  # noqa: E402
from tests.rollout.sidecar import Sidecar  # noqa: E402
from tests.vllm.conftest import GREEDY  # noqa: E402
from weight_sync import weights_checksum  # noqa: E402

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    side = Sidecar(qwen2_dir, "--engine", "vllm", "--host-copy", "off", "--http-port", "0", "--weight-transfer-routes",
                   token="")
    yield side
    side.stop()


def test_vllms_trainer_code_pushes_into_vllms_engine_through_the_sidecar(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        before, version = client.weights_checksums(), client.stats()["version"]
        out = subprocess.run([sys.executable, "-m", "tests.rl_routes.vllm_trainer", "--url", sidecar.http_url,
                              "--model", qwen2_dir, "--wrong-shape"], capture_output=True, text=True, timeout=200)
        assert out.returncode == 1 and "wrong shapes" in out.stdout, out.stderr[-2000:]
        assert client.weights_checksums() == before and client.stats()["version"] == version
        first = client.generate([[5, 6, 7]], GREEDY)[0][0].token_ids
        _train(sidecar, qwen2_dir, "--seed", "7", "--version", str(version + 3))
        assert client.weights_checksums() == [weights_checksum(perturbed(qwen2_dir, 7).named_parameters())]
        assert httpx.get(sidecar.http_url + "/weight_info").json() == {"weight_version": str(version + 3)}
        [[r]] = client.generate([[5, 6, 7]], GREEDY)
        assert r.weight_versions == [version + 3] * len(r.token_ids) and r.token_ids != first
    finally:
        client.close()
