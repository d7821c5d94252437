"""Engines that heal: a real sidecar whose engine cores are SIGKILLed under load. Every rollout
comes back whole, the engine is restarted and catches up (from its sibling, or from the host
copy when it is alone), the next push reaches it with no init_weight_sync by the user, and a
spent restart budget leaves the sidecar unhealthy with the reason."""

import concurrent.futures
import copy
import os
import signal
import time

import pytest
import torch

from engine import SamplingParams
from rollout import RolloutClient, SidecarError
from tests.engine.helpers import hf_greedy, random_prompts
from tests.rollout.in_flight import kill_mid_decode
from tests.rollout.sidecar import TOKEN, Sidecar
from rollout.sidecar.supervision import HOST_COPY_PREFIX, SHM_DIR
from weight_sync import weights_checksum
from weight_sync.common.shm_names import sweep_orphans

pytestmark = pytest.mark.timeout(300)


def _cores(client) -> list[int]:
    """The engines' core processes, in engine order (a warm standby core is not among them)."""
    return [s["pid"] for s in client.health()["engine_states"]]


def _perturbed(model, seed):
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def _wait_healthy(client, timeout=90.0) -> tuple[dict, float]:
    t0 = time.monotonic()
    while not (health := client.health())["ok"]:
        assert time.monotonic() - t0 < timeout, f"not healthy {timeout} s after the kill: {health}"
        time.sleep(0.1)
    return health, time.monotonic() - t0


def _wait_host_copy(client, version: int, timeout=30.0) -> None:
    """Until the host copy (written in the background after a push) holds `version`."""
    t0 = time.monotonic()
    while client.stats()["host_copy_version"] != version:
        assert time.monotonic() - t0 < timeout, f"no host copy of version {version} after {timeout} s"
        time.sleep(0.05)


def test_an_engine_killed_under_load_loses_no_rollout_and_comes_back(qwen2_dir, hf_models):
    # the catch-up from the sibling; a warm standby makes the restart (the path users get by default)
    sidecar = Sidecar(qwen2_dir, "--num-engines", "2", "--host-copy", "off", "--warm-standby", "on")
    client = RolloutClient(sidecar.url, token=TOKEN)
    loader = RolloutClient(sidecar.url, token=TOKEN)
    marker = RolloutClient(sidecar.url, token=TOKEN)
    try:
        trainer = _perturbed(hf_models["qwen2"], 1)
        client.init_weight_sync()
        client.push_weights(trainer, version=1)
        want = weights_checksum(trainer.named_parameters())
        prompts = random_prompts(32, 5, 20, 2000, seed=7)
        params = SamplingParams(n=2, temperature=0, max_tokens=40, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pending = kill_mid_decode(client, marker, pool, lambda: pool.submit(loader.generate, prompts, params),
                                      seqs=2 * len(prompts), victim=1)
            groups = pending.result(timeout=240)
        # every rollout whole, greedy as HF on the pushed weights, however its pieces were generated
        for p, g in zip(prompts, groups):
            assert len(g) == 2
            ref = hf_greedy(trainer, p, 40, ignore_eos=True)
            for r in g:
                assert r.finish_reason == "length" and r.token_ids == ref and r.weight_versions == [1] * 40
        stats = client.stats()
        assert stats["engine_deaths"] == 1 and stats["resubmitted_after_engine_death"] >= 1
        health, _ = _wait_healthy(client)
        assert [s["restarts"] for s in health["engine_states"]] == [0, 1]
        assert [s["version"] for s in health["engine_states"]] == [1, 1]
        assert client.stats()["engine_restarts"] == 1
        assert client.weights_checksums() == [want, want]
        assert client.stats()["last_restart"]["source"] == "engine 0"  # caught up from its sibling
        # the next push reaches both engines: the client forms a new group by itself
        trainer2 = _perturbed(trainer, 2)
        client.push_weights(trainer2, version=2)
        want2 = weights_checksum(trainer2.named_parameters())
        assert client.weights_checksums() == [want2, want2]
        out = client.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [g[0].token_ids for g in out] == [hf_greedy(trainer2, p, 8, ignore_eos=True) for p in prompts[:4]]
    finally:
        marker.close()
        loader.close()
        client.close()
        sidecar.stop()


def test_a_lone_engine_comes_back_from_the_host_copy(qwen2_dir, hf_models):
    sidecar = Sidecar(qwen2_dir, "--num-engines", "1", "--host-copy", "on")
    client = RolloutClient(sidecar.url, token=TOKEN)
    try:
        trainer = _perturbed(hf_models["qwen2"], 3)
        client.init_weight_sync()
        client.push_weights(trainer, version=5)
        want = weights_checksum(trainer.named_parameters())
        _wait_host_copy(client, 5)
        [core] = _cores(client)
        os.kill(core, signal.SIGKILL)
        prompt = [11, 12, 13]
        # a generate during the restart waits for the engine, then answers from the pushed weights
        [[r]] = client.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert r.token_ids == hf_greedy(trainer, prompt, 6, ignore_eos=True) and r.weight_versions == [5] * 6
        health, _ = _wait_healthy(client)
        assert health["engine_states"][0]["restarts"] == 1 and _cores(client) != [core]
        assert client.weights_checksums() == [want] and client.stats()["last_restart"]["source"] == "host copy"
        trainer2 = _perturbed(trainer, 4)
        client.push_weights(trainer2, version=6)
        assert client.weights_checksums() == [weights_checksum(trainer2.named_parameters())]
        # a SIGKILLed sidecar cannot free its host copy (a model of RAM): the next one sweeps it
        time.sleep(0.5)
        owned = f"{HOST_COPY_PREFIX}{sidecar.proc.pid}-"
        os.kill(sidecar.proc.pid, signal.SIGKILL)
        sidecar.proc.wait()
        assert [n for n in os.listdir(SHM_DIR) if n.startswith(owned)]
        sweep_orphans((HOST_COPY_PREFIX,), SHM_DIR)
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(owned)]
    finally:
        client.close()
        sidecar.stop()


def test_a_spent_restart_budget_leaves_the_sidecar_unhealthy_with_the_reason(qwen2_dir):
    sidecar = Sidecar(qwen2_dir, "--num-engines", "1", "--max-restarts", "1")
    client = RolloutClient(sidecar.url, token=TOKEN, timeout_s=60)
    try:
        os.kill(_cores(client)[0], signal.SIGKILL)
        _wait_healthy(client)
        os.kill(_cores(client)[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (health := client.health())["engine_states"][0]["state"] != "dead":
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        assert not health["ok"] and health["engines"] == 0 and "restart budget spent" in health["reason"]
        t0 = time.monotonic()
        with pytest.raises(SidecarError, match="no engine can serve"):
            client.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        assert time.monotonic() - t0 < 5
    finally:
        client.close()
        sidecar.stop()
