"""TRL's GRPOTrainer in server mode against the sidecar, as against `vllm serve` (issue 40): it
generates through the OpenAI front and syncs its weights through vLLM's RL routes over NCCL, which
TRL runs on CUDA only (the trainer on cuda:0, the sidecar on cuda:1: NCCL holds one rank per GPU).
The CPU half (TRL's client generating and parsing our answers) is tests/rl_routes/test_trl_client.py."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


def test_trls_grpo_trainer_trains_against_the_sidecar(qwen2_dir, tmp_path):
    pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from rollout import RolloutClient
    from tests.rollout.sidecar import Sidecar
    from weight_sync import weights_checksum

    side = Sidecar(qwen2_dir, "--http-port", "0", "--weight-transfer-routes", "--device", "cuda:1", token="")
    client = RolloutClient(side.url)
    try:
        version = client.stats()["version"]
        args = trl.GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server",
                              vllm_server_base_url=side.http_url, per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=8, max_steps=2, logging_steps=1, report_to="none", bf16=False)
        prompts = Dataset.from_dict({"prompt": ["a b c", "d e f", "g h i", "j k l"] * 2})
        trainer = trl.GRPOTrainer(model=qwen2_dir, reward_funcs=lambda completions, **kw: [len(c) / 8.0
                                                                                          for c in completions],
                                  args=args, train_dataset=prompts)
        trainer.train()
        assert client.stats()["version"] >= version + 2  # a sync before each step's generation
        trainer.vllm_generation.sync_weights()  # the trained weights, once more
        want = weights_checksum((n, p.detach().cpu()) for n, p in trainer.model.named_parameters())
        assert client.weights_checksums() == [want]
    finally:
        client.close()
        side.stop()
