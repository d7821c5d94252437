"""SGLang's RL routes on a sidecar of two engines (rollout/sidecar/sglang_transfer.py,
rollout/sidecar/openai_front/sglang_routes.py), driven by a trainer made of slime's and AReaL's own group
set-up and HTTP calls (tests/sglang_routes/sglang_trainer.py): the sidecar then serves exactly the
trainer's weights, and /generate answers as slime and AReaL parse it."""

import json
import subprocess
import sys
import time

import httpx
import pytest

from rollout import RolloutClient
from tests.engine.helpers import hf_greedy, random_prompts
from tests.sglang_routes.sglang_trainer import perturbed, push_here
from weight_sync import weights_checksum

pytestmark = pytest.mark.timeout(300)


def _checksum(model_dir, seed):
    return weights_checksum(perturbed(model_dir, seed).named_parameters())


def _trainer(sidecar, model_dir, *flags):
    out = subprocess.run([sys.executable, "-m", "tests.sglang_routes.sglang_trainer", "--url", sidecar.http_url,
                          "--model", model_dir, *flags], capture_output=True, text=True, timeout=180)
    return out, (json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {})


def slime_parse(output: dict) -> dict:
    """slime/rollout/sglang_rollout.py `generate` + slime/utils/types.py `append_response_tokens`."""
    meta = output["meta_info"]
    tokens = [item[1] for item in meta["output_token_logprobs"]]
    log_probs = [item[0] for item in meta["output_token_logprobs"]]
    status = {"length": "TRUNCATED", "abort": "ABORTED", "stop": "COMPLETED"}[meta["finish_reason"]["type"]]
    return {"tokens": tokens, "log_probs": log_probs, "text": output["text"], "status": status,
            "weight_version": meta["weight_version"]}


def areal_parse(response: dict) -> dict:
    """AReaL's areal/engine/sglang_remote.py `SGLangBackend.parse_generation_response`."""
    meta_info = response["meta_info"]
    stop_reason = meta_info["finish_reason"]["type"]
    return {"output_tokens": [x[1] for x in meta_info["output_token_logprobs"]],
            "output_logprobs": [x[0] for x in meta_info["output_token_logprobs"]], "stop_reason": stop_reason}


def test_slimes_trainer_pushes_into_two_engines_in_buckets(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        version = client.stats()["version"]
        sent = push_here(sidecar.http_url, qwen2_dir, seed=3, buffer_bytes=1 << 20, version=str(version + 2))
        assert sent["buckets"] > 1 and sent["world_size"] == 3  # tp_size 2: the two engines' workers
        assert client.weights_checksums() == [_checksum(qwen2_dir, 3)] * 2
        assert httpx.get(sidecar.http_url + "/get_weight_version").json() == {"weight_version": str(version + 2)}
        want = perturbed(qwen2_dir, 3)
        for prompt in random_prompts(2, 4, 10, 2000, seed=5):  # slime's payload, slime's parsing
            out = httpx.post(sidecar.http_url + "/generate", timeout=60, json={
                "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "top_k": -1,
                                    "skip_special_tokens": False, "no_stop_trim": True,
                                    "spaces_between_special_tokens": False, "custom_params": {"x": 1}}}).json()
            got = slime_parse(out)
            assert got["tokens"] == hf_greedy(want, prompt, 6, ignore_eos=True)
            assert got["status"] == "TRUNCATED" and got["weight_version"] == str(version + 2)
            assert out["meta_info"]["weight_versions"] == [version + 2] * 6 and len(got["log_probs"]) == 6
    finally:
        client.close()


def test_areals_calls_with_a_flattened_bucket_land(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        version = client.stats()["version"]
        sent = push_here(sidecar.http_url, qwen2_dir, seed=4, buffer_bytes=1 << 30, flattened=True, areal=True)
        assert sent["buckets"] == 1
        assert client.weights_checksums() == [_checksum(qwen2_dir, 4)] * 2
        assert client.stats()["version"] == version + 1  # AReaL sends no weight_version: the current + 1
        out = httpx.post(sidecar.http_url + "/generate", timeout=60, json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0,
                                                        "top_k": 1, "ignore_eos": True, "stop_token_ids": [],
                                                        "frequency_penalty": 0.0}, "return_logprob": True,
            "stream": False, "image_data": None}).json()
        got = areal_parse(out)
        assert got["stop_reason"] == "length" and len(got["output_tokens"]) == len(got["output_logprobs"]) == 4
    finally:
        client.close()


def test_a_wrong_shape_is_refused_by_name_and_nothing_changes(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        before, version = client.weights_checksums(), client.stats()["version"]
        out, said = _trainer(sidecar, qwen2_dir, "--wrong-shape", "--buffer-bytes", str(1 << 30))
        assert out.returncode == 1, out.stderr[-2000:]
        assert "400" in said["error"] and "wrong shapes" in said["body"] and "model.norm.weight" in said["body"]
        assert client.weights_checksums() == before and client.stats()["version"] == version
        push_here(sidecar.http_url, qwen2_dir, seed=6)  # the next trainer's update lands
        assert client.weights_checksums() == [_checksum(qwen2_dir, 6)] * 2
    finally:
        client.close()


def test_a_trainer_killed_between_buckets_changes_nothing(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        before, version = client.weights_checksums(), client.stats()["version"]
        out, _ = _trainer(sidecar, qwen2_dir, "--die-after", "2", "--buffer-bytes", str(1 << 20))
        assert out.returncode == -9
        httpx.post(sidecar.http_url + "/continue_generation", timeout=60)  # the dead trainer paused the engines
        assert client.weights_checksums() == before and client.stats()["version"] == version
        push_here(sidecar.http_url, qwen2_dir, seed=7)  # the next trainer takes the group and lands
        assert client.weights_checksums() == [_checksum(qwen2_dir, 7)] * 2
        assert [e["version"] for e in client.health()["engine_states"]] == [version + 1] * 2
    finally:
        client.close()


def test_one_trainer_owns_the_group_until_it_is_gone(sidecar, qwen2_dir):
    first = subprocess.Popen([sys.executable, "-m", "tests.sglang_routes.sglang_trainer", "--url", sidecar.http_url,
                              "--model", qwen2_dir, "--hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "joined"
        out, said = _trainer(sidecar, qwen2_dir, "--seed", "8")
        assert out.returncode == 1 and "409" in said["error"] and "another trainer" in said["body"]
    finally:
        first.kill()
        first.wait()
    push_here(sidecar.http_url, qwen2_dir, seed=8)
    client = RolloutClient(sidecar.url)
    try:
        assert client.weights_checksums() == [_checksum(qwen2_dir, 8)] * 2
    finally:
        client.close()


def test_generate_streams_as_sglang_and_names_bad_fields(sidecar):
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True,
                                                       "unknown_knob": 3}, "stream": True, "return_logprob": True}
    chunks = []
    with httpx.stream("POST", sidecar.http_url + "/generate", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 5} and len(last["output_ids"]) == 5
    assert all(c["output_ids"] == last["output_ids"][:len(c["output_ids"])] for c in chunks)  # cumulative
    whole = httpx.post(sidecar.http_url + "/generate", json={**body, "stream": False}, timeout=60).json()
    assert whole["output_ids"] == last["output_ids"] and whole["text"] == last["text"]
    batch = httpx.post(sidecar.http_url + "/generate", timeout=60, json={
        "input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 3]
    for bad, field in (({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
                       ({"text": "x", "sampling_params": {"max_new_tokens": 1.5}}, "sampling_params.max_new_tokens"),
                       ({"input_ids": "x"}, "input_ids"), ({"text": "x", "return_logprob": "yes"}, "return_logprob")):
        r = httpx.post(sidecar.http_url + "/generate", json=bad, timeout=30)
        assert r.status_code == 400 and field in r.text, (bad, r.text)


def test_control_routes_answer_as_sglang(sidecar, qwen2_dir, tmp_path):
    url = sidecar.http_url
    r = httpx.post(url + "/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": "x",
                                                               "rank_offset": 1, "world_size": 3, "backend": "gloo"})
    assert r.status_code == 400 and r.json()["success"] is False and "master_port" in r.json()["message"]
    r = httpx.post(url + "/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                               "rank_offset": 1, "world_size": 3, "backend": "nccl"})
    assert r.status_code == 400 and "gloo" in r.json()["message"]
    r = httpx.post(url + "/update_weights_from_distributed", json={"names": [], "dtypes": [], "shapes": [],
                                                                     "group_name": "nobody"})
    assert r.status_code == 400 and "group_name" in r.json()["message"]
    assert httpx.post(url + "/pause_generation", json={"mode": "sideways"}).status_code == 400
    for mode in ("abort", "retract", "in_place"):
        assert httpx.post(url + "/pause_generation", json={"mode": mode}, timeout=60).json()["success"] is True
        assert httpx.post(url + "/continue_generation", timeout=60).json()["success"] is True
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    info = httpx.get(url + "/get_model_info").json()
    assert info["is_generation"] is True and info["weight_version"] == httpx.get(url + "/get_weight_version").json()[
        "weight_version"]
    # from disk: an HF checkpoint directory, all or nothing
    client = RolloutClient(sidecar.url)
    try:
        version = client.stats()["version"]
        perturbed(qwen2_dir, 11).save_pretrained(tmp_path / "ckpt")
        r = httpx.post(url + "/update_weights_from_disk", timeout=120,
                       json={"model_path": str(tmp_path / "ckpt"), "weight_version": str(version + 1)})
        assert r.json()["success"] is True, r.text
        assert client.weights_checksums() == [_checksum(qwen2_dir, 11)] * 2
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "none")}, timeout=60)
        assert r.status_code == 400 and "model_path" in r.json()["message"]
        r = httpx.post(url + "/update_weight_version", json={"new_version": "step-9"})
        assert r.status_code == 400 and client.stats()["version"] == version + 1
    finally:
        client.close()
    t0 = time.monotonic()
    assert httpx.post(url + "/release_memory_occupation", timeout=60).json()["success"] is True
    assert httpx.post(url + "/resume_memory_occupation", timeout=60).json()["success"] is True
    assert time.monotonic() - t0 < 60
