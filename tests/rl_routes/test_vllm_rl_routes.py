"""vLLM's RL routes on the sidecar (rollout/sidecar/vllm_transfer.py, rollout/sidecar/openai_front/rl_routes.py),
driven by a trainer process made of vLLM's own client, group and packing code
(tests/rl_routes/vllm_trainer.py): the sidecar then serves exactly the trainer's weights."""

import base64
import json
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("vllm")

from engine import SamplingParams  # noqa: E402
from rollout import RolloutClient  # noqa: E402
from tests.engine.helpers import hf_greedy, random_prompts  # noqa: E402
from tests.rl_routes.vllm_trainer import perturbed, push_here  # noqa: E402
from tests.rollout.sidecar import Sidecar  # noqa: E402
from weight_sync import weights_checksum  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _train(sidecar, model_dir, **options) -> dict:
    """vLLM's trainer code, in this process (tests/rl_routes/vllm_trainer.py); the fault tests run it
    as a process of its own."""
    return push_here(sidecar.http_url, model_dir, **options)


def test_vllms_own_trainer_code_pushes_into_our_engine(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        version = client.stats()["version"]
        sent = _train(sidecar, qwen2_dir, seed=3)
        assert sent["chunks"] > 1 and sent["world_size"] == 2
        want = perturbed(qwen2_dir, 3)
        assert client.weights_checksums() == [weights_checksum(want.named_parameters())]
        assert httpx.get(sidecar.http_url + "/weight_info").json() == {"weight_version": str(version + 1)}
        prompts = random_prompts(3, 4, 12, 2000, seed=9)
        groups = client.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [g[0].token_ids for g in groups] == [hf_greedy(want, p, 8, ignore_eos=True) for p in prompts]
        assert all(g[0].weight_versions == [version + 1] * 8 for g in groups)
        same = httpx.post(sidecar.http_url + "/update_weight_version", json={"new_version": str(version + 1)})
        assert same.json() == {"success": True, "new_version": str(version + 1)}
        other = httpx.post(sidecar.http_url + "/update_weight_version", json={"new_version": "step-9"})
        assert other.status_code == 409 and "finish_weight_update" in other.text
        assert httpx.get(sidecar.http_url + "/weight_info").json() == {"weight_version": str(version + 1)}
        assert httpx.post(sidecar.http_url + "/reset_prefix_cache").json() == {"success": True}
    finally:
        client.close()


def _serving(client, checksum):
    assert client.weights_checksums() == [checksum]
    [[r]] = client.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(r.token_ids) == 3


def test_a_wrong_shape_is_refused_by_name_and_the_trainer_does_not_hang(sidecar, qwen2_dir):
    client = RolloutClient(sidecar.url)
    try:
        before, version = client.weights_checksums()[0], client.stats()["version"]
        out = subprocess.run([sys.executable, "-m", "tests.rl_routes.vllm_trainer", "--url", sidecar.http_url,
                              "--model", qwen2_dir, "--wrong-shape"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr[-2000:]
        said = json.loads(out.stdout.strip().splitlines()[-1])
        assert "400" in said["error"] and "wrong shapes" in said["body"] and "model.norm.weight" in said["body"]
        assert client.stats()["version"] == version
        _serving(client, before)
        _train(sidecar, qwen2_dir, seed=4)  # the next trainer's push lands
        assert client.weights_checksums() == [weights_checksum(perturbed(qwen2_dir, 4).named_parameters())]
    finally:
        client.close()


def test_a_trainer_killed_mid_update_changes_nothing(sidecar, qwen2_dir):
    import time

    client = RolloutClient(sidecar.url)
    try:
        before, version = client.weights_checksums()[0], client.stats()["version"]
        proc = subprocess.run([sys.executable, "-m", "tests.rl_routes.vllm_trainer", "--url", sidecar.http_url,
                               "--model", qwen2_dir, "--die-after", "1"], capture_output=True, timeout=120)
        assert proc.returncode == -9
        t0 = time.monotonic()
        [[r]] = client.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert time.monotonic() - t0 < 2.0 and r.weight_versions == [version] * 3  # never paused
        deadline = time.monotonic() + 30
        while client.health()["pushing"]:  # the sidecar sees the trainer gone and gives its update up
            assert time.monotonic() < deadline
            time.sleep(0.2)
        _serving(client, before)
        _train(sidecar, qwen2_dir, seed=5)
        assert client.weights_checksums() == [weights_checksum(perturbed(qwen2_dir, 5).named_parameters())]
    finally:
        client.close()


def test_bad_bodies_get_a_400_naming_the_field(sidecar):
    def post(path, body):
        return httpx.post(sidecar.http_url + path, json=body, timeout=30)

    r = post("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": "x",
                                                            "world_size": 2}})
    assert r.status_code == 400 and "init_info.master_port" in r.text
    r = post("/init_weight_transfer_engine", {"init_info": {"nccl_unique_id_b64": "AAAA", "world_size": 2}})
    assert r.status_code == 400 and "nccl_unique_id_b64" in r.text and "128 bytes" in r.text
    uid = base64.b64encode(bytes(range(128))).decode()  # a well-formed id: NCCL's, so CUDA's
    r = post("/init_weight_transfer_engine", {"init_info": {"nccl_unique_id_b64": uid, "world_size": 2}})
    assert r.status_code == 400 and "CUDA" in r.text and "master_address" in r.text
    r = post("/init_weight_transfer_engine", {"init_info": {"nccl_unique_id_b64": uid, "master_address": "127.0.0.1",
                                                            "master_port": 1, "world_size": 2}})
    assert r.status_code == 400 and "not both" in r.text
    assert post("/init_weight_transfer_engine", {}).status_code == 400  # no init_info at all: pydantic names it
    assert post("/update_weights", {"update_info": {"names": "x"}}).status_code in (400, 409)
    r = post("/finish_weight_update", {"weight_version": "v2"})
    assert r.status_code == 409 and "update" in r.text  # nothing staged
    assert httpx.post(sidecar.http_url + "/pause?mode=sideways", timeout=30).status_code == 400
    assert httpx.get(sidecar.http_url + "/is_paused", timeout=30).json() == {"is_paused": False}
    info = httpx.get(sidecar.http_url + "/server_info?config_format=json", timeout=30).json()["vllm_config"]
    assert info["model_config"]["dtype"] == "float32" and info["weight_transfer_config"]["backend"] == "nccl"
    assert httpx.get(sidecar.http_url + "/server_info?config_format=yaml", timeout=30).status_code == 400


def test_the_weight_checker_shows_a_push_wrote_every_weight(sidecar, qwen2_dir):
    """vLLM's /weight_checker use: checksum, reset (zeros), push, compare with the checksum."""
    import hashlib

    def check(action, **body):
        r = httpx.post(sidecar.http_url + "/weight_checker", json={"action": action, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    _train(sidecar, qwen2_dir, seed=5)
    pushed = check("checksum")["checksums"]
    want = perturbed(qwen2_dir, 5)
    names = [n for n, _ in want.named_parameters()]
    assert sorted(pushed) == sorted(f"dp0:pp0:pcp0:tp0:{n}" for n in names)
    norm = want.model.norm.weight.detach().numpy().tobytes()
    assert pushed["dp0:pp0:pcp0:tp0:model.norm.weight"] == hashlib.sha256(norm).hexdigest()
    assert check("compare", baseline=pushed) == {"match": True, "mismatches": []}
    assert check("reset") == {"status": "reset"}
    assert check("compare", baseline=pushed)["mismatches"] == sorted(pushed)  # every weight is zero now
    _train(sidecar, qwen2_dir, seed=5)  # the same weights again, over zeros
    assert check("compare", baseline=pushed) == {"match": True, "mismatches": []}
    for body in ({"action": "shred"}, {"action": "compare"}):
        r = httpx.post(sidecar.http_url + "/weight_checker", json=body, timeout=30)
        assert r.status_code == 400 and ("action" in r.text or "baseline" in r.text)
    assert httpx.post(sidecar.http_url + "/start_draft_weight_update", timeout=30).status_code == 400


def test_a_keep_mode_push_through_the_routes_tags_each_token_with_its_version(sidecar, qwen2_dir):
    """/pause?mode=keep while a completion streams, the update, /finish_weight_update with a version,
    /resume: the completion finishes, its first tokens from the old version and the rest from the new."""
    version = httpx.get(sidecar.http_url + "/weight_info").json()["weight_version"]
    body = {"model": "qwen2", "prompt": [7, 8, 9], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    tokens, versions = [], []
    with httpx.stream("POST", sidecar.http_url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            c = json.loads(line[6:])["choices"][0]
            tokens += c.get("token_ids") or []
            versions += c.get("weight_versions") or []
            if len(tokens) >= 5 and not httpx.get(sidecar.http_url + "/is_paused").json()["is_paused"] \
                    and str(int(version) + 5) != httpx.get(sidecar.http_url + "/weight_info").json()["weight_version"]:
                assert httpx.post(sidecar.http_url + "/pause?mode=keep", timeout=60).json() == {"status": "paused"}
                _train(sidecar, qwen2_dir, seed=6, version=str(int(version) + 5))
                assert httpx.post(sidecar.http_url + "/resume", timeout=60).json() == {"status": "resumed"}
    assert len(tokens) == len(versions) == 200
    old, new = int(version), int(version) + 5
    assert set(versions) == {old, new} and versions[0] == old and versions == sorted(versions)
    assert httpx.get(sidecar.http_url + "/weight_info").json() == {"weight_version": str(new)}


def test_one_trainer_owns_the_routes_until_it_is_gone(sidecar, qwen2_dir):
    first = subprocess.Popen([sys.executable, "-m", "tests.rl_routes.vllm_trainer", "--url", sidecar.http_url,
                              "--model", qwen2_dir, "--hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "joined"
        out = subprocess.run([sys.executable, "-m", "tests.rl_routes.vllm_trainer", "--url", sidecar.http_url,
                              "--model", qwen2_dir, "--seed", "8"], capture_output=True, text=True, timeout=120)
        said = json.loads(out.stdout.strip().splitlines()[-1])
        assert out.returncode == 1 and "409" in said["error"] and "another trainer" in said["body"]
    finally:
        first.kill()
        first.wait()
    _train(sidecar, qwen2_dir, seed=8)  # the owner is gone: the next trainer takes the routes
    client = RolloutClient(sidecar.url)
    try:
        assert client.weights_checksums() == [weights_checksum(perturbed(qwen2_dir, 8).named_parameters())]
    finally:
        client.close()


def test_a_sidecar_with_a_token_wants_it_on_these_routes(qwen2_dir):
    side = Sidecar(qwen2_dir, "--http-port", "0", "--weight-transfer-routes", token="route-secret")
    try:
        out = subprocess.run([sys.executable, "-m", "tests.rl_routes.vllm_trainer", "--url", side.http_url,
                              "--model", qwen2_dir], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and "401" in json.loads(out.stdout.strip().splitlines()[-1])["error"]
        _train(side, qwen2_dir, seed=9, token="route-secret")  # the README's few lines
        client = RolloutClient(side.url, token="route-secret")
        try:
            assert client.weights_checksums() == [weights_checksum(perturbed(qwen2_dir, 9).named_parameters())]
        finally:
            client.close()
    finally:
        side.stop()


def test_two_engines_take_their_rank_offsets_and_commit_together(qwen2_dir):
    """Two engines behind one sidecar: vLLM's trainer sees a world of 1 + 2, each engine joins at
    its own offset, and the finish commits on both at one version."""
    side = Sidecar(qwen2_dir, "--http-port", "0", "--weight-transfer-routes", "--num-engines", "2", token="")
    client = RolloutClient(side.url)
    try:
        assert httpx.get(side.http_url + "/get_world_size", timeout=30).json() == {"world_size": 2}
        version = client.stats()["version"]
        sent = push_here(side.http_url, qwen2_dir, seed=13)
        assert sent["world_size"] == 3
        assert client.weights_checksums() == [weights_checksum(perturbed(qwen2_dir, 13).named_parameters())] * 2
        assert [e["version"] for e in client.health()["engine_states"]] == [version + 1] * 2
    finally:
        client.close()
        side.stop()
