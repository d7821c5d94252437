"""vLLM's RL routes on the sidecar (rollout/vllm_transfer.py, rollout/openai_front/rl_routes.py),
driven by a trainer process made of vLLM's own client, group and packing code
(tests/rl_routes/vllm_trainer.py): the sidecar then serves exactly the trainer's weights."""

import json
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("vllm")

from engine import SamplingParams  # noqa: E402
from rollout import RolloutClient  # noqa: E402
from tests.engine.helpers import hf_greedy, random_prompts  # noqa: E402
from tests.rl_routes.vllm_trainer import perturbed  # noqa: E402
from tests.rollout.sidecar import Sidecar  # noqa: E402
from weight_sync import weights_checksum  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    side = Sidecar(qwen2_dir, "--http-port", "0", "--weight-transfer-routes", token="")
    yield side
    side.stop()


def _train(sidecar, model_dir, *extra) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.rl_routes.vllm_trainer", "--url", sidecar.http_url,
                          "--model", model_dir, *extra], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllms_own_trainer_code_pushes_into_our_engine(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        version = client.stats()["version"]
        sent = _train(sidecar, qwen2_dir, "--seed", "3")
        assert sent["chunks"] > 1 and sent["world_size"] == 2
        want = perturbed(qwen2_dir, 3)
        assert client.weights_checksums() == [weights_checksum(want.named_parameters())]
        assert httpx.get(sidecar.http_url + "/weight_info").json() == {"weight_version": str(version + 1)}
        prompts = random_prompts(3, 4, 12, 2000, seed=9)
        groups = client.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [g[0].token_ids for g in groups] == [hf_greedy(want, p, 8, ignore_eos=True) for p in prompts]
        assert all(g[0].weight_versions == [version + 1] * 8 for g in groups)
    finally:
        client.close()
