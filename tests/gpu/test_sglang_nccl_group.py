"""SGLang's RL routes on a CUDA engine: the trainer's group over NCCL as SGLang forms it, driven by
slime's trainer code (init_process_group, backend "nccl"; per-tensor and flattened-bucket updates) and by
TorchRL's SGLangWeightSyncScheme unpatched (its NCCL, its CUDA calls, its init naming no backend), into
a sidecar on the second GPU (`python -m pytest -m gpu tests/gpu`; NCCL holds one rank per GPU)."""

import httpx
import pytest
import torch

from rollout import RolloutClient
from tests.engine.helpers import hf_greedy
from tests.rollout.sidecar import Sidecar
from tests.sglang_routes.sglang_trainer import perturbed, push_here
from tests.sglang_routes.torchrl_driver import policy, sync_here
from weight_sync import weights_checksum

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
              pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def side(qwen2_dir):
    side = Sidecar(qwen2_dir, "--http-port", "0", "--sglang-routes", "--device", "cuda:1", token="")
    torch.cuda.set_device(0)  # the trainer's GPU
    yield side
    side.stop()


def test_slimes_trainer_pushes_over_nccl_into_a_cuda_engine(side, qwen2_dir):
    client = RolloutClient(side.url)
    try:
        for seed, flattened in ((3, False), (4, True)):
            push_here(side.http_url, qwen2_dir, seed=seed, backend="nccl", flattened=flattened,
                      buffer_bytes=1 << 20 if not flattened else 1 << 30)
            want = weights_checksum((n, p.cuda()) for n, p in perturbed(qwen2_dir, seed).named_parameters())
            assert client.weights_checksums() == [want]
    finally:
        client.close()


def test_torchrls_weight_sync_pushes_over_nccl_into_a_cuda_engine(side, qwen2_dir):
    client = RolloutClient(side.url)
    try:
        version = client.stats()["version"]
        said = sync_here(side.http_url, qwen2_dir, seed=5, steps=2, backend="nccl")
        assert said["world_size"] == 2 and said["policy_version"] == 2
        want = policy(qwen2_dir, 5, 2).to("cuda:1")  # HF on the engine's GPU, as tests/gpu/test_cuda.py
        assert client.weights_checksums() == [weights_checksum(want.named_parameters())]
        out = httpx.post(side.http_url + "/generate", timeout=60, json={
            "input_ids": [5, 6, 7, 8], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}).json()
        with torch.device("cuda:1"):
            greedy = hf_greedy(want, [5, 6, 7, 8], 6, ignore_eos=True)
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == greedy
        assert out["meta_info"]["weight_versions"] == [version + 2] * 6
    finally:
        client.close()
