"""Device names as users write them: "cuda" alone is this process's current CUDA device, with
its index (torch.cuda.set_device and NCCL refuse an unindexed one)."""

import torch

from engine.model_runner import resolve_device


def test_cuda_without_an_index_takes_the_current_device():
    assert resolve_device("cuda", current_cuda_index=lambda: 3) == torch.device("cuda", 3)


def test_indexed_and_cpu_devices_are_kept():
    asked = []
    assert resolve_device("cuda:1", current_cuda_index=lambda: asked.append(1) or 0) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    assert not asked  # an indexed device never asks CUDA which one is current
