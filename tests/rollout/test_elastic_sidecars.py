"""Elastic sidecars (issue 18): one client, several real sidecar processes. A sidecar SIGKILLed under
load is dropped and its unfinished prompts come back from the others; a push after it (or during
it) reaches the survivors; a sidecar added mid-run gets no prompt until a push gave it the newest
weights, then serves."""

import concurrent.futures
import os
import signal
import time

import pytest

from engine import SamplingParams
from rollout import RolloutClient
from tests.engine.helpers import hf_greedy, random_prompts
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_engine_faults import _perturbed
from weight_sync import weights_checksum

pytestmark = pytest.mark.timeout(300)


def _wait_for_tokens(client) -> None:
    """Until every sidecar of the client is decoding."""
    deadline = time.monotonic() + 60
    while not all(s["queue_depth"] > 0 for s in client.stats()):
        assert time.monotonic() < deadline, "the load never started"
        time.sleep(0.02)
    time.sleep(0.3)


@pytest.mark.slow  # in CI through tests/ray_cluster's kill test: the same drop, re-send and regroup
def test_a_killed_sidecar_is_dropped_and_its_prompts_come_back_from_the_other(qwen2_dir, hf_models):
    a, b = Sidecar(qwen2_dir), Sidecar(qwen2_dir)
    client = RolloutClient([a.url, b.url], token=TOKEN)
    watcher = RolloutClient([a.url, b.url], token=TOKEN, timeout_s=10)
    try:
        trainer = _perturbed(hf_models["qwen2"], 1)
        client.init_weight_sync()
        client.push_weights(trainer, version=1)
        prompts = random_prompts(16, 5, 20, 2000, seed=3)
        params = SamplingParams(n=2, temperature=0, max_tokens=60, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.generate, prompts, params)
            _wait_for_tokens(watcher)
            os.kill(b.proc.pid, signal.SIGKILL)
            groups = pending.result(timeout=240)
        for p, g in zip(prompts, groups):  # every prompt whole, b's from a, as greedy as HF
            ref = hf_greedy(trainer, p, 60, ignore_eos=True)
            assert len(g) == 2 and all(r.token_ids == ref and r.weight_versions == [1] * 60 for r in g)
        assert client.urls == [a.url]
        # the next push forms its group without b, with no init_weight_sync by the user
        trainer2 = _perturbed(trainer, 2)
        client.push_weights(trainer2, version=2)
        assert client.weights_checksums() == [weights_checksum(trainer2.named_parameters())]
    finally:
        watcher.close()
        client.close()
        a.stop()
        b.stop()


def test_a_sidecar_killed_during_a_push_leaves_the_push_to_the_other(qwen2_dir, hf_models):
    a, b = Sidecar(qwen2_dir), Sidecar(qwen2_dir)
    client = RolloutClient([a.url, b.url], token=TOKEN)
    try:
        client.init_weight_sync(bucket_bytes=1 << 16)  # many buckets: the kill lands mid-transfer
        trainer = _perturbed(hf_models["qwen2"], 3)

        def kill_b(bucket, n_buckets):
            if bucket == 2:
                os.kill(b.proc.pid, signal.SIGKILL)
                time.sleep(0.5)  # its connection closes before the last bucket goes out

        t0 = time.monotonic()
        client.push_weights(trainer, version=1, progress=kill_b)
        took = time.monotonic() - t0
        assert client.urls == [a.url]
        assert client.weights_checksums() == [weights_checksum(trainer.named_parameters())]
        assert took < 30, f"the push took {took:.1f} s with a sidecar killed in it"
    finally:
        client.close()
        a.stop()
        b.stop()


@pytest.mark.slow  # in CI through tests/hosts' returning host and tests/ray_cluster's restarted actor
def test_a_sidecar_added_mid_run_is_caught_up_from_a_peer_and_the_next_push_reaches_it(qwen2_dir, hf_models):
    """After a push, b is added: a sends it version 1 (no push, nothing from the trainer); b then
    takes prompts, greedy as HF on version 1, and the next push forms a group with it by itself."""
    a, b = Sidecar(qwen2_dir), Sidecar(qwen2_dir)
    client = RolloutClient(a.url, token=TOKEN)
    b_only = RolloutClient(b.url, token=TOKEN)
    try:
        client.init_weight_sync()
        trainer = _perturbed(hf_models["qwen2"], 5)
        client.push_weights(trainer, version=1)
        client.add_sidecar(b.url, wait=True)
        assert client.states == {a.url: "active", b.url: "active"}
        assert b_only.stats()["version"] == 1 and b_only.stats()["pushes"] == 1  # a's push into it
        want = weights_checksum(trainer.named_parameters())
        assert client.weights_checksums() == [want, want]
        prompts = random_prompts(8, 5, 20, 2000, seed=4)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        groups = client.generate(prompts, params)
        assert b_only.stats()["rollouts"] > 0
        assert [g[0].token_ids for g in groups] == [hf_greedy(trainer, p, 8, ignore_eos=True) for p in prompts]
        trainer2 = _perturbed(trainer, 6)
        client.push_weights(trainer2, version=2)  # b joins the group here, with no init_weight_sync by the user
        want = weights_checksum(trainer2.named_parameters())
        assert client.weights_checksums() == [want, want]
        groups = client.generate(prompts, params)
        assert [g[0].token_ids for g in groups] == [hf_greedy(trainer2, p, 8, ignore_eos=True) for p in prompts]
        assert all(g[0].weight_versions == [2] * 8 for g in groups)
    finally:
        b_only.close()
        client.close()
        a.stop()
        b.stop()


@pytest.mark.slow  # the mid-run addition above takes the same path, plus the push it waits for
def test_a_sidecar_added_before_any_push_serves_at_once(qwen2_dir):
    a, b = Sidecar(qwen2_dir), Sidecar(qwen2_dir)
    client = RolloutClient(a.url, token=TOKEN)
    b_only = RolloutClient(b.url, token=TOKEN)
    try:
        client.add_sidecar(b.url)
        client.generate(random_prompts(8, 5, 20, 2000, seed=5), SamplingParams(max_tokens=4))
        assert b_only.stats()["rollouts"] > 0
        client.remove_sidecar(b.url)
        assert client.urls == [a.url]
        before = b_only.stats()["rollouts"]
        client.generate(random_prompts(8, 5, 20, 2000, seed=6), SamplingParams(max_tokens=4))
        assert b_only.stats()["rollouts"] == before
    finally:
        b_only.close()
        client.close()
        a.stop()
        b.stop()
