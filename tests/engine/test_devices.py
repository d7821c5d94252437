"""Device names as users write them: "cuda" alone is this process's current CUDA device, with
its index (torch.cuda.set_device and NCCL refuse an unindexed one)."""

import pytest
import torch

from engine.model_runner import resolve_device


def test_cuda_without_an_index_takes_the_current_device():
    assert resolve_device("cuda", current_cuda_index=lambda: 3) == torch.device("cuda", 3)


def test_indexed_and_cpu_devices_are_kept():
    asked = []
    assert resolve_device("cuda:1", current_cuda_index=lambda: asked.append(1) or 0) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    assert not asked  # an indexed device never asks CUDA which one is current


def test_dtype_auto_is_the_checkpoints_on_a_gpu_and_float32_on_the_cpu(tmp_path):
    import json

    from engine.config import resolve_dtype

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "dtype": "bfloat16"}))
    assert resolve_dtype("auto", "cuda", str(tmp_path)) == "bfloat16"
    assert resolve_dtype("auto", "cuda:1", str(tmp_path)) == "bfloat16"
    assert resolve_dtype("auto", "cpu", str(tmp_path)) == "float32"
    assert resolve_dtype("float16", "cuda", str(tmp_path)) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "float16"}))
    assert resolve_dtype("auto", "cuda", str(tmp_path)) == "float16"  # the pre-v5 key
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert resolve_dtype("auto", "cuda", str(tmp_path)) == "float32"
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("fp8", "cuda", str(tmp_path))


def test_a_push_travels_in_the_engines_dtype():
    import torch

    from rollout.client.weight_sync_client import wire_dtype

    assert wire_dtype([{"dtype": "bfloat16"}, {"dtype": "bfloat16"}]) is torch.bfloat16
    assert wire_dtype([{"dtype": "bfloat16"}, {"dtype": "float32"}]) is None  # mixed: each tensor's own
    assert wire_dtype([{}]) is None  # an older sidecar that does not say
