"""SGLang's RL routes on CUDA engines: the trainer's group over NCCL as SGLang forms it (slime's
init_process_group, backend "nccl"), per-tensor and flattened-bucket updates into the sidecar
(`python -m pytest -m gpu tests/gpu`); skipped elsewhere."""

import pytest
import torch

from rollout import RolloutClient
from tests.rollout.sidecar import Sidecar
from tests.sglang_routes.sglang_trainer import perturbed, push_here
from weight_sync import weights_checksum

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]


def test_slimes_trainer_pushes_over_nccl_into_a_cuda_engine(qwen2_dir):
    side = Sidecar(qwen2_dir, "--http-port", "0", "--sglang-routes", "--device", "cuda", token="")
    client = RolloutClient(side.url)
    try:
        for seed, flattened in ((3, False), (4, True)):
            push_here(side.http_url, qwen2_dir, seed=seed, backend="nccl", flattened=flattened,
                      buffer_bytes=1 << 20 if not flattened else 1 << 30)
            want = weights_checksum((n, p.cuda()) for n, p in perturbed(qwen2_dir, seed).named_parameters())
            assert client.weights_checksums() == [want]
    finally:
        client.close()
        side.stop()
