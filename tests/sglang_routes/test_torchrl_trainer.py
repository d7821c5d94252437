"""TorchRL's SGLang weight sync as the trainer (tests/sglang_routes/torchrl_trainer.py, TorchRL's own
code, on gloo; run by torchrl_driver.py as TorchRL's GRPO runs it) pushing into a sidecar of two
engines over SGLang's routes: the engines serve exactly its weights, a wrong shape is refused by name,
a trainer killed or frozen mid-update changes nothing, and a second trainer is refused while the first
one's update is in flight."""

import json
import subprocess
import sys

import httpx
import pytest

from rollout import RolloutClient
from tests.engine.helpers import hf_greedy
from tests.sglang_routes.torchrl_driver import policy, sync_here
from weight_sync import weights_checksum

pytestmark = pytest.mark.timeout(300)

DRIVER = [sys.executable, "-m", "tests.sglang_routes.torchrl_driver"]


def _driver(sidecar, model_dir, *flags, timeout=180) -> tuple[int, dict]:
    out = subprocess.run([*DRIVER, "--url", sidecar.http_url, "--model", model_dir, *flags], capture_output=True,
                         text=True, timeout=timeout)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    return out.returncode, json.loads(lines[-1])


def _stalled(sidecar, model_dir, seed: int) -> tuple[subprocess.Popen, dict]:
    """A TorchRL trainer frozen before its 5th tensor's broadcast, its update call in flight."""
    proc = subprocess.Popen([*DRIVER, "--url", sidecar.http_url, "--model", model_dir, "--seed", str(seed),
                             "--stall-at", "5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "the trainer exited before its update"
    return proc, json.loads(line)


def test_torchrls_sender_pushes_into_two_engines(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        version = client.stats()["version"]
        said = sync_here(sidecar.http_url, qwen2_dir, seed=3, steps=2)
        assert said["world_size"] == 3 and said["policy_version"] == 2  # tp_size 2: the two engines' workers
        assert client.weights_checksums() == [said["checksum"]] * 2
        want = policy(qwen2_dir, 3, 2)
        assert weights_checksum(want.named_parameters()) == said["checksum"]  # the trainer's, recomputed
        # TorchRL sends no weight_version: each update_weights() is the sidecar's current + 1
        assert client.stats()["version"] == version + said["policy_version"]
        for prompt in ([5, 6, 7, 8], [100, 200, 300]):
            out = httpx.post(sidecar.http_url + "/generate", timeout=60, json={
                "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}).json()
            assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == hf_greedy(want, prompt, 6,
                                                                                             ignore_eos=True)
            assert out["meta_info"]["weight_version"] == str(version + 2)
            assert out["meta_info"]["weight_versions"] == [version + 2] * 6
    finally:
        client.close()


def test_a_wrong_shape_or_an_untied_weight_is_refused_by_name_then_a_good_update_lands(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        before, version = client.weights_checksums(), client.stats()["version"]
        code, said = _driver(sidecar, qwen2_dir, "--seed", "4", "--spoil", "wrong-shape", "--spoil", "untied")
        assert code == 0, said
        shape, untied = ([a for a in r["answers"] if a["route"] == "update_weights_from_distributed"]
                         for r in said["refused"])
        assert shape and shape[0]["status"] == 400, said  # before any byte
        assert "model.norm.weight" in shape[0]["body"] and "nothing changed" in shape[0]["body"]
        assert untied and untied[0]["status"] == 400, said  # once its bytes arrived: they are not the embedding's
        assert "lm_head.weight (tied to model.embed_tokens.weight)" in untied[0]["body"]
        assert before != [said["checksum"]] * 2  # the refused updates moved nothing; the good one then landed
        assert client.weights_checksums() == [said["checksum"]] * 2
        assert client.stats()["version"] == version + 1
    finally:
        client.close()


def test_a_second_trainer_is_refused_while_the_firsts_update_is_in_flight(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    before, version = client.weights_checksums(), client.stats()["version"]
    first, stalled = _stalled(sidecar, qwen2_dir, seed=5)
    try:
        code, said = _driver(sidecar, qwen2_dir, "--seed", "6", "--timeout", "2")
        assert code == 1 and "timed out" in said["error"]  # TorchRL's own words for a group that never formed
        refused = [a for a in said["answers"] if a["route"] == "init_weights_update_group"]
        assert refused and refused[0]["status"] == 409 and stalled["group"] in refused[0]["body"], said
        assert "mid-update" in refused[0]["body"]
        # its update call (TorchRL's payload) names a group that is not here: refused, naming the busy one
        r = httpx.post(sidecar.http_url + "/update_weights_from_distributed", timeout=30, json={
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
            "group_name": "weight_update_group_0badc0de", "flush_cache": False, "abort_all_requests": False})
        assert r.status_code == 409 and stalled["group"] in r.json()["message"], r.text
        assert client.weights_checksums() == before and client.stats()["version"] == version  # none of it served
        first.stdin.write("go\n")
        first.stdin.flush()
        done = json.loads(first.stdout.readline())
        assert first.wait(timeout=60) == 0, done
        assert client.weights_checksums() == [done["checksum"]] * 2  # the first update, whole
        assert client.stats()["version"] == version + 1
    finally:
        first.kill()
        first.wait()
        client.close()


def test_a_trainer_killed_mid_update_leaves_the_weights_and_the_next_lands(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    before, version = client.weights_checksums(), client.stats()["version"]
    first, _ = _stalled(sidecar, qwen2_dir, seed=7)
    try:
        first.kill()  # SIGKILL between two of its broadcasts
        assert first.wait(timeout=30) == -9
        assert client.weights_checksums() == before and client.stats()["version"] == version
        said = sync_here(sidecar.http_url, qwen2_dir, seed=8)
        assert client.weights_checksums() == [said["checksum"]] * 2
        assert [e["version"] for e in client.health()["engine_states"]] == [version + 1] * 2
        out = httpx.post(sidecar.http_url + "/generate", timeout=60, json={
            "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 3}}).json()
        assert out["meta_info"]["weight_version"] == str(version + 1)
    finally:
        first.kill()
        first.wait()
        client.close()
