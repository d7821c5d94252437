"""SGLang's RL routes on a vLLM engine (`rollout.serve --engine vllm --sglang-routes`): slime's trainer
code (tests/sglang_routes/sglang_trainer.py) pushes, in buckets, into vLLM's worker through our receiver;
then TorchRL's (tests/sglang_routes/torchrl_trainer.py: one call, its state dict with the tied lm_head)."""

import httpx
import pytest

pytest.importorskip("vllm")

from rollout import RolloutClient  # noqa: E402
from tests.engine.helpers import hf_greedy  # noqa: E402
from tests.rollout.sidecar import Sidecar  # noqa: E402
from tests.sglang_routes.sglang_trainer import perturbed, push_here  # noqa: E402
from tests.sglang_routes.torchrl_driver import policy, sync_here  # noqa: E402
from weight_sync import weights_checksum  # noqa: E402

pytestmark = pytest.mark.timeout(400)


def test_slimes_trainer_pushes_into_a_vllm_engine(qwen2_dir):
    side = Sidecar(qwen2_dir, "--engine", "vllm", "--host-copy", "off", "--http-port", "0", "--sglang-routes",
                   token="")
    client = RolloutClient(side.url)
    try:
        version = client.stats()["version"]
        sent = push_here(side.http_url, qwen2_dir, seed=3, buffer_bytes=1 << 20)
        assert sent["buckets"] > 1 and sent["world_size"] == 2
        want = perturbed(qwen2_dir, 3)
        assert client.weights_checksums() == [weights_checksum(want.named_parameters())]
        out = httpx.post(side.http_url + "/generate", timeout=120, json={
            "input_ids": [5, 6, 7, 8], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}).json()
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == hf_greedy(want, [5, 6, 7, 8], 6,
                                                                                         ignore_eos=True)
        assert out["meta_info"]["weight_version"] == str(version + 1)
        said = sync_here(side.http_url, qwen2_dir, seed=4)  # TorchRL's, into the same engine
        want = policy(qwen2_dir, 4, 1)
        assert said["world_size"] == 2 and client.weights_checksums() == [said["checksum"]]
        assert said["checksum"] == weights_checksum(want.named_parameters())
        out = httpx.post(side.http_url + "/generate", timeout=120, json={
            "input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
            "return_logprob": True}).json()
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == hf_greedy(want, [5, 6, 7, 8], 6,
                                                                                         ignore_eos=True)
        assert out["meta_info"]["weight_versions"] == [version + 2] * 6
    finally:
        client.close()
        side.stop()
