"""Tensor parallelism through vLLM (`rollout.serve --engine vllm --tensor-parallel-size 2`, one core
per rank): the weight-sync group holds both workers (world = 1 + engines x 2), a push lands on
both ranks, and a SIGKILLed worker takes its engine down, which comes back with the newest
weights; vLLM's own trainer code reaches both ranks through vLLM's RL routes. One sidecar for the module (a TP=2 vLLM start costs 20-50 s on 2 cores)."""

import concurrent.futures
import os
import signal
import time

import pytest

pytest.importorskip("vllm")

from engine import SamplingParams  # noqa: E402
from rollout import RolloutClient  # noqa: E402
from tests.engine.helpers import hf_greedy, random_prompts  # noqa: E402
from tests.procs import descendants  # noqa: E402
from tests.rollout.sidecar import TOKEN, Sidecar  # noqa: E402
from tests.rollout.test_engine_faults import _wait_healthy  # noqa: E402
from tests.rollout.test_sidecar import perturb  # noqa: E402
from tests.vllm.conftest import greedy, hf_greedy_all  # noqa: E402
from weight_sync import weights_checksum  # noqa: E402

pytestmark = pytest.mark.timeout(400)
PROMPTS = random_prompts(4, 4, 20, 2000, seed=78)


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    s = Sidecar(qwen2_dir, "--engine", "vllm", "--tensor-parallel-size", "2", "--host-copy", "on",
                "--http-port", "0", "--weight-transfer-routes")  # vLLM's RL routes too (the last test)
    yield s
    s.stop()



def _workers(core_pid: int) -> list[int]:
    """vLLM's worker processes under its engine core (they name themselves VLLM::Worker...)."""
    out = []
    for pid in descendants(core_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"Worker" in f.read():
                    out.append(pid)
        except OSError:
            continue
    return out


def test_two_ranks_are_greedy_as_one_and_a_push_lands_on_both(client, trainer, hf_models):
    # greedy as HF's fp32 forward, which vLLM with one rank equals token for token (tests/vllm/test_vllm_sidecar.py)
    assert greedy(client, PROMPTS) == hf_greedy_all(hf_models["qwen2"], PROMPTS)
    info = client.init_weight_sync(take_over=True)
    assert info["world_size"] == 3  # the trainer and both ranks of the one engine
    assert client.weights_checksums() == [weights_checksum(trainer.named_parameters())] * 2
    perturb(trainer, 11, scale=0.05)
    client.push_weights(trainer, version=1)
    assert client.weights_checksums() == [client._client.sender.checksum(trainer)] * 2
    assert greedy(client, PROMPTS) == hf_greedy_all(trainer, PROMPTS)


@pytest.mark.slow  # 77 s; CI keeps the heal of a killed vLLM core (tests/vllm/test_vllm_sidecar.py) for suite time
def test_a_killed_worker_takes_its_engine_down_and_it_comes_back_with_the_newest_weights(client, trainer):
    if client.stats()["version"] != 1:
        pytest.skip("needs the push of the test before")
    want = client._client.sender.checksum(trainer)
    prompts = random_prompts(16, 4, 20, 2000, seed=79)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    core = client.health()["engine_states"][0]["pid"]
    workers = _workers(core)
    assert len(workers) == 2, f"vLLM's workers under {core}: {workers}"
    loader = RolloutClient(client.urls[0], token=TOKEN)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(loader.generate, prompts, params)
            deadline = time.monotonic() + 60
            while client.stats()["queue_depth"] == 0:
                assert time.monotonic() < deadline, "the load never started"
                time.sleep(0.02)
            time.sleep(0.5)
            os.kill(workers[1], signal.SIGKILL)
            groups = pending.result(timeout=300)
    finally:
        loader.close()
    # every rollout whole and greedy on the pushed weights, whichever engine start made its tokens
    for p, g in zip(prompts, groups):
        assert g[0].finish_reason == "length" and g[0].token_ids == hf_greedy(trainer, p, 32, ignore_eos=True)
        assert g[0].weight_versions == [1] * 32
    health, _ = _wait_healthy(client, timeout=180)
    assert health["engine_states"][0]["restarts"] == 1 and health["engine_states"][0]["pid"] != core
    assert client.stats()["last_restart"]["source"] == "host copy"
    assert client.weights_checksums() == [want, want]
    assert greedy(client, PROMPTS) == hf_greedy_all(trainer, PROMPTS)


def test_vllms_trainer_code_reaches_both_ranks_through_the_rl_routes(sidecar, client, qwen2_dir):
    """vLLM's RL routes on a TP=2 engine: the trainer's group is 1 + both ranks (rank offsets 1
    and 2), every chunk reaches each rank, and the push commits on both."""
    import httpx

    from tests.rl_routes.vllm_trainer import perturbed, push_here

    client.close_weight_sync()  # the first test's trainer (ours) owned the weight sync
    assert httpx.get(sidecar.http_url + "/get_world_size", headers=_auth(), timeout=30).json() == {"world_size": 2}
    version = client.stats()["version"]
    sent = push_here(sidecar.http_url, qwen2_dir, seed=12, token=TOKEN)
    assert sent["world_size"] == 3 and sent["chunks"] > 1
    want = perturbed(qwen2_dir, 12)
    assert client.weights_checksums() == [weights_checksum(want.named_parameters())] * 2
    assert client.stats()["version"] == version + 1
    assert greedy(client, PROMPTS) == hf_greedy_all(want, PROMPTS)


def _auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}
