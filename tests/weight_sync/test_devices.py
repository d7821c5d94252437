"""Placement, as one rule: device spelling, engines on devices, two ranks on one GPU."""

import pytest
import torch

from recipes.rl_train import build_parser, sidecar_command, sidecar_device
from weight_sync.common.devices import device_identity, duplicate_gpus, engine_devices, normalize_device
from weight_sync.common.group import WeightSyncGroup


def test_devices_are_spelled_one_way():
    assert normalize_device("cpu") == torch.device("cpu")
    assert normalize_device("cuda:3") == torch.device("cuda", 3)
    bare = normalize_device("cuda")  # the current device (0 when CUDA is absent)
    assert bare.type == "cuda" and bare.index is not None
    assert normalize_device(torch.device("cuda", 1)) == normalize_device("cuda:1")


@pytest.mark.parametrize("device,n,gpus,want", [
    ("cpu", 3, None, ["cpu", "cpu", "cpu"]),
    ("cuda", 2, None, ["cuda:0", "cuda:1"]),
    ("cuda", 2, "1,2", ["cuda:1", "cuda:2"]),
    ("cuda:1,cuda:3", 2, None, ["cuda:1", "cuda:3"]),
    ("cuda:2", 1, None, ["cuda:2"]),
])
def test_engines_are_placed_by_one_rule(device, n, gpus, want):
    assert engine_devices(device, n, gpus) == want


@pytest.mark.parametrize("device,n,gpus,match", [
    ("cuda:1", 2, None, "2 engines but 1 devices"),
    ("cuda:1,cuda:1", 2, None, "two engines on cuda:1"),
    ("cuda", 2, "1,1", "two engines on cuda:1"),
    ("cuda", 3, "1,2", "3 engines but 2 devices"),
    ("cuda:0", 1, "1", "--gpus goes with --device cuda"),
    ("gpu", 1, None, "device"),
    ("cpu", 0, None, "num-engines"),
])
def test_bad_placements_are_refused_before_anything_starts(device, n, gpus, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        engine_devices(device, n, gpus)


@pytest.mark.parametrize("device,n,gpus,want", [
    ("cuda", 2, None, ["cuda:0,1", "cuda:2,3"]),
    ("cuda", 1, "4,5", ["cuda:4,5"]),
    ("cuda:1,cuda:2,cuda:5,cuda:6", 2, None, ["cuda:1,2", "cuda:5,6"]),
    ("cpu", 2, None, ["cpu", "cpu"]),
])
def test_a_tensor_parallel_engine_takes_the_next_n_gpus(device, n, gpus, want):
    assert engine_devices(device, n, gpus, per_engine=2) == want


def test_too_few_gpus_for_tensor_parallel_engines_are_refused_with_the_count():
    with pytest.raises(ValueError, match="2 engines x 2 tensor-parallel ranks take 4 GPUs"):
        engine_devices("cuda", 2, "1,2,3", per_engine=2)


def test_two_ranks_on_one_gpu_are_named():
    a = {"host": "h1", "device": "cuda:0", "gpu": "GPU-aaaa"}
    b = {"host": "h1", "device": "cuda:1", "gpu": "GPU-bbbb"}
    same_gpu_other_index = {"host": "h1", "device": "cuda:0", "gpu": "GPU-bbbb"}  # other CUDA_VISIBLE_DEVICES
    assert duplicate_gpus({0: a, 1: b}) == []
    assert duplicate_gpus({0: a, 1: {**a, "host": "h2"}}) == []  # same index, other host
    (problem,) = duplicate_gpus({0: a, 1: b, 2: same_gpu_other_index})
    assert "ranks 1 and 2" in problem and "GPU-bbbb" in problem
    assert duplicate_gpus({0: device_identity(torch.device("cpu")), 1: device_identity(torch.device("cpu"))}) == []


def test_a_group_normalises_its_device_and_picks_its_backend():
    g = WeightSyncGroup(host="127.0.0.1", port=1, world_size=2, rank=1, group_name="x", timeout_s=1, device="cuda",
                        secret="s")
    assert g.device.index is not None and g.backend_name == "nccl"
    g = WeightSyncGroup(host="127.0.0.1", port=1, world_size=2, rank=1, group_name="x", timeout_s=1, device="cpu",
                        secret="s")
    assert g.backend_name == "gloo"


def test_the_recipes_pass_placement_to_their_sidecar():
    args = build_parser("grpo").parse_args([])
    assert sidecar_device(torch.device("cpu")) == "cpu"
    assert sidecar_device(torch.device("cuda", 0)) == "cuda:1"  # never the trainer's GPU
    assert sidecar_device(torch.device("cuda", 0), "cuda:3") == "cuda:3"
    cmd = sidecar_command(args, "DIR", torch.device("cuda", 2))
    assert cmd[cmd.index("--device") + 1] == "cuda:3"
    args = build_parser("ppo").parse_args(["--sidecar-device", "cuda:5"])
    cmd = sidecar_command(args, "DIR", torch.device("cpu"))
    assert cmd[cmd.index("--device") + 1] == "cuda:5"


def test_the_sidecar_refuses_a_bad_placement_at_once():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rollout.serve", "--device", "cuda:1,cuda:1", "--num-engines", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "bad placement: two engines on cuda:1" in out.stderr


def test_the_recipes_pass_the_sidecars_quantization():
    for argv, want in (([], "none"), (["--sidecar-quantization", "int8"], "int8")):
        cmd = sidecar_command(build_parser("grpo").parse_args(argv), "DIR", torch.device("cpu"))
        assert cmd[cmd.index("--quantization") + 1] == want
