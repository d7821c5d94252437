"""vLLM's users turn its RL routes on with VLLM_SERVER_DEV_MODE=1, as for `vllm serve`: the sidecar
started with it (and without --weight-transfer-routes) serves them; =0 leaves them off, and a
value vLLM could not read ends the sidecar with one line."""

import os
import subprocess
import sys

import httpx

from tests.rollout.sidecar import Sidecar


def test_vllm_server_dev_mode_serves_the_rl_routes_without_the_flag(qwen2_dir):
    side = Sidecar(qwen2_dir, "--http-port", "0", token="", env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        assert httpx.get(side.http_url + "/get_world_size", timeout=30).json() == {"world_size": 1}
        assert httpx.get(side.http_url + "/weight_info", timeout=30).json() == {"weight_version": "0"}
    finally:
        assert side.stop() == 0


def test_vllm_server_dev_mode_0_leaves_the_rl_routes_off(qwen2_dir):
    side = Sidecar(qwen2_dir, "--http-port", "0", token="", env={"VLLM_SERVER_DEV_MODE": "0"})
    try:
        assert httpx.get(side.http_url + "/v1/models", timeout=30).status_code == 200
        assert httpx.get(side.http_url + "/get_world_size", timeout=30).status_code == 404
    finally:
        assert side.stop() == 0


def test_a_dev_mode_vllm_could_not_read_ends_the_sidecar_with_one_line(qwen2_dir):
    out = subprocess.run([sys.executable, "-m", "rollout.serve", "--model", qwen2_dir, "--port", "0",
                          "--http-port", "0"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd(), "VLLM_SERVER_DEV_MODE": "yes"})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "VLLM_SERVER_DEV_MODE='yes'" in lines[0], out.stderr
