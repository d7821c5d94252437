"""The `--engine vllm` flags and settings that need no vLLM to check: these run with or without it."""

import subprocess
import sys

import pytest
import torch

from engine.vllm_start import apply_env_defaults, cpu_bind_error, cpu_env_defaults
from recipes.rl_train import build_parser, seeds_requests, sidecar_command


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout.serve", *args], capture_output=True, text=True, timeout=120)


def test_tensor_parallelism_needs_the_vllm_engine():
    out = _serve("--tensor-parallel-size", "2")
    assert out.returncode != 0 and "--engine vllm" in out.stderr


def test_a_cpu_binding_for_another_rank_count_is_refused_before_anything_starts(tmp_path):
    """A VLLM_CPU_OMP_THREADS_BIND set up for one rank (say, inherited) would kill a TP-2 core at
    start with an assertion; the sidecar says what is wrong instead, and exits."""
    import os

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    out = subprocess.run([sys.executable, "-m", "rollout.serve", "--engine", "vllm", "--tensor-parallel-size", "2",
                          "--model", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and "needs one per rank" in out.stderr and "'0|1'" in out.stderr


@pytest.mark.parametrize("bind, ranks, ok", [(None, 2, True), ("auto", 4, True), ("nobind", 2, True), ("0|1", 2, True),
                                             ("0-3", 1, True), ("0,1", 2, False), ("0|1", 1, False)])
def test_the_cpu_binding_needs_one_group_per_rank(monkeypatch, bind, ranks, ok):
    if bind is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    assert (cpu_bind_error(ranks) is None) is ok


def test_help_says_how_to_change_the_vllm_settings():
    out = _serve("--help")
    assert out.returncode == 0
    for name in ("--engine {native,vllm}", "--tensor-parallel-size", "VLLM_CPU_OMP_THREADS_BIND",
                 "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD"):
        assert name in out.stdout


def test_vllm_settings_start_on_every_cpu_one_group_per_rank():
    assert cpu_env_defaults(1, [0, 1])["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert cpu_env_defaults(2, [0, 1])["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert cpu_env_defaults(2, [2, 3, 5, 7])["VLLM_CPU_OMP_THREADS_BIND"] == "2,3|5,7"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu_env_defaults(4, [0, 1])  # fewer CPUs than ranks: vLLM decides
    assert cpu_env_defaults(1, [0])["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_the_users_vllm_settings_win(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_LOGGING_STREAM",
                 "VLLM_LOGGING_LEVEL", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"):
        monkeypatch.setenv(name, "")  # recorded, so that what the defaults set is undone after the test
        monkeypatch.delenv(name)
    applied = apply_env_defaults("cpu", 1, "warning")
    assert "VLLM_CPU_KVCACHE_SPACE" not in applied
    assert applied["VLLM_LOGGING_STREAM"] == "ext://sys.stderr" and applied["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert applied["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == "15"  # loaded cores overran vLLM's 5 s
    assert "VLLM_CPU_OMP_THREADS_BIND" not in apply_env_defaults("cuda", 1, "INFO")  # set once, kept


@pytest.mark.parametrize("engine, device, seeded", [("native", None, True), ("vllm", None, False),
                                                    ("vllm", "cuda:1", True)])
def test_the_recipes_pass_the_engine_and_seed_requests_where_it_can(engine, device, seeded):
    argv = ["--engine", engine] + (["--sidecar-device", device] if device else [])
    args = build_parser("grpo").parse_args(argv)
    cmd = sidecar_command(args, "DIR", torch.device("cpu"))
    assert cmd[cmd.index("--engine") + 1] == engine
    assert seeds_requests(args, torch.device("cpu")) is seeded


def test_routed_experts_are_refused_by_name_on_the_vllm_engine():
    """vLLM's own enable_return_routed_experts is not wired through the sidecar: a request asking for
    routed experts fails by name before it reaches vLLM (docs/guides/moe.md)."""
    pytest.importorskip("vllm")
    from engine import SamplingParams
    from engine.vllm_convert import to_vllm_params

    with pytest.raises(ValueError, match="return_routed_experts: not a sampling parameter the vLLM engine takes"):
        to_vllm_params(SamplingParams(return_routed_experts=True), on_cpu=True)
    assert to_vllm_params(SamplingParams(max_tokens=3), on_cpu=True).max_tokens == 3
