"""Overlapped pushes (issue 15): the bytes arrive while the engines keep generating, and the engines
pause only for the swap. Real sidecar processes, a real trainer process, gloo on loopback."""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine import SamplingParams
from rollout import RolloutClient, SidecarError
from tests.engine.helpers import hf_greedy
from tests.rollout.in_flight import wait_stats
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_engine_faults import _perturbed, _wait_healthy
from weight_sync import weights_checksum

pytestmark = pytest.mark.timeout(300)

# A trainer whose transfer stops for a while at bucket 3 (a slow link), then goes on or dies there.
SLOW_TRAINER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
from rollout import RolloutClient
url, token, model, pause_s = sys.argv[1:5]
client = RolloutClient(url, token=token)
client.init_weight_sync(bucket_bytes=256 * 1024, take_over=True)
m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
with torch.no_grad():
    for p in m.parameters():
        p.mul_(1.5)
def slow(k, n):
    if k == 3:
        print(json.dumps({"at": k}), flush=True)
        time.sleep(float(pause_s))
out = client.push_weights(m, version=7, progress=slow)
print(json.dumps({"done": out["version"]}), flush=True)
"""


def _trainer(sidecar, model_dir, pause_s):
    return subprocess.Popen([sys.executable, "-c", SLOW_TRAINER, sidecar.url, TOKEN, model_dir, str(pause_s)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def _requests_finished_meanwhile(client, seconds: float) -> int:
    """Short requests sent back to back for `seconds`: how many came back."""
    done, stop = [0], time.monotonic() + seconds
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        def loop():
            c = RolloutClient(client.urls[0], token=TOKEN)
            try:
                while time.monotonic() < stop:
                    c.generate([[5, 6, 7]], params)
                    done[0] += time.monotonic() < stop  # came back within the window
            finally:
                c.close()
        pool.submit(loop).result()
    return done[0]


@pytest.mark.parametrize("overlap", [  # off (pause for the transfer) is also in test_sidecar's frozen-trainer test
    "on", pytest.param("off", marks=pytest.mark.slow)])
def test_rollouts_go_on_while_a_push_arrives(qwen2_dir, overlap):
    """A transfer held up for 3 s at bucket 3: with the overlapped receive requests keep coming
    back meanwhile; with the engines paused for the transfer, none does. How many come back depends
    on the load of the machine (2 under CI's 2 busy workers), so the check is none against some."""
    s = Sidecar(qwen2_dir, "--overlap-receive", overlap)
    client = RolloutClient(s.url, token=TOKEN)
    trainer = _trainer(s, qwen2_dir, 3)
    try:
        assert json.loads(trainer.stdout.readline()) == {"at": 3}
        served = _requests_finished_meanwhile(client, 1.5)
        assert json.loads(trainer.stdout.readline()) == {"done": 7}
        assert client.stats()["version"] == 7
        if overlap == "on":  # any request back at all: paused engines return none (the "off" case)
            assert served >= 1
            assert client.stats()["pause_seconds"] < 0.5  # the swap only, not the 3 s transfer
        else:
            assert served == 0
    finally:
        trainer.kill()
        trainer.wait()
        client.close()
        s.stop()


def test_a_trainer_killed_mid_transfer_never_pauses_the_engines(qwen2_dir, hf_models):
    s = Sidecar(qwen2_dir)
    client = RolloutClient(s.url, token=TOKEN)
    trainer = _trainer(s, qwen2_dir, 3600)
    try:
        prompt = [9, 10, 11]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        before = client.generate([prompt], params)[0][0].token_ids
        core = client.health()["engine_states"][0]["pid"]
        assert json.loads(trainer.stdout.readline()) == {"at": 3}
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 15
        while client.stats()["failed_pushes"] == 0:  # noticed within a couple of seconds
            assert time.monotonic() < deadline, "the push of a dead trainer was never given up"
            time.sleep(0.1)
        stats, health = client.stats(), client.health()
        assert stats["pause_seconds"] == 0 and stats["version"] == 0 and stats["engine_restarts"] == 0
        assert health["engine_states"][0]["pid"] == core  # not restarted: it never waited in the transfer
        assert client.generate([prompt], params)[0][0].token_ids == before
        # the next trainer forms a new group and pushes
        new = _perturbed(hf_models["qwen2"], 9)
        client.init_weight_sync()
        client.push_weights(new, version=8)
        assert client.weights_checksums() == [weights_checksum(new.named_parameters())]
        assert client.generate([prompt], params)[0][0].token_ids == hf_greedy(new, prompt, 8, ignore_eos=True)
    finally:
        trainer.kill()
        trainer.wait()
        client.close()
        s.stop()


def test_a_bad_manifest_is_refused_without_a_pause(qwen2_dir, hf_models):
    s = Sidecar(qwen2_dir)
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        bad = [(n, t) for n, t in hf_models["qwen2"].named_parameters() if "layers.0." not in n]  # names missing
        load = threading.Thread(target=_requests_finished_meanwhile, args=(client, 2.0))
        load.start()
        with pytest.raises(SidecarError, match="missing") as e:
            client.push_weights(bad, version=3)
        load.join()
        assert e.value.kind == "refused"
        stats = client.stats()
        assert stats["pause_seconds"] == 0 and stats["pause_wait_seconds"] == 0 and stats["version"] == 0
        client.push_weights(hf_models["qwen2"], version=3)  # the group is still usable
        assert client.stats()["version"] == 3
    finally:
        client.close()
        s.stop()


def _long_rollouts(url, out: dict, prompts=None, params=None):
    """Seconds of decoding (by default 32 x 250 tokens) from a client of their own, for a thread:
    records their groups (or error) and when they ended."""
    c = RolloutClient(url, token=TOKEN)
    try:
        out["groups"] = c.generate(prompts or [[5, 6, 7]] * 32,
                                   params or SamplingParams(temperature=1.0, max_tokens=250, ignore_eos=True))
    except Exception as e:  # noqa: BLE001 - the test reads it
        out["error"] = e
    finally:
        out["ended"] = time.monotonic()
        c.close()


def test_push_without_waiting_returns_once_the_bytes_are_out(qwen2_dir, hf_models):
    """wait=False in wait mode: push_weights returns while the engines still finish their requests;
    the trainer may change its model at once (the engines hold the bytes sent), and the handle
    gives the result once they swapped."""
    s = Sidecar(qwen2_dir)
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        new = _perturbed(hf_models["qwen2"], 9)
        pushed = weights_checksum(new.named_parameters())
        long = {}
        load = threading.Thread(target=_long_rollouts, args=(s.url, long))
        load.start()
        # every request is on the engine before the push (a wait-mode swap waits for them)
        wait_stats(client, lambda st: st["queue_depth"] == 32, "the load never reached the engine")
        handle = client.push_weights(new, version=5, pause_mode="wait", wait=False)
        returned = time.monotonic()
        with torch.no_grad():  # the trainer's next step, while the engines swap
            for p in new.parameters():
                p.mul_(0.5)
        assert handle.result(timeout=120)["version"] == 5
        load.join()
        assert "error" not in long
        # returned before the rollouts ended (the client's own clock, one thread after the other)
        assert returned < long["ended"]
        # ...and the swap waited for them, as the engines saw it: every request ran its 250 tokens on
        # the old weights (comparing the two reply threads' clocks instead races by microseconds)
        assert all(len(r.token_ids) == 250 and set(r.weight_versions) == {0} for g in long["groups"] for r in g)
        assert client.stats()["pause_wait_seconds"] > 0
        assert client.weights_checksums() == [pushed]  # what was sent, not what the trainer did after
        prompt = [9, 10, 11]
        got = client.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0][0]
        assert got.token_ids == hf_greedy(_perturbed(hf_models["qwen2"], 9), prompt, 8, ignore_eos=True)
        assert set(got.weight_versions) == {5}
    finally:
        client.close()
        s.stop()


def test_a_push_without_waiting_whose_sidecar_dies_raises_from_its_handle(qwen2_dir, hf_models):
    s = Sidecar(qwen2_dir)
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        long = {}
        load = threading.Thread(target=_long_rollouts, args=(s.url, long))
        load.start()
        wait_stats(client, lambda st: st["queue_depth"] == 32, "the load never reached the engine")
        handle = client.push_weights(_perturbed(hf_models["qwen2"], 9), version=5, pause_mode="wait", wait=False)
        assert not handle.done()  # the swap waits for seconds of decoding
        s.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(SidecarError):
            handle.result(timeout=60)
        assert time.monotonic() - t0 < 10  # noticed when the connection closed, not at a timeout
        load.join()
        with pytest.raises(SidecarError):  # the next push says so too, without hanging
            client.push_weights(hf_models["qwen2"], version=6)
    finally:
        client.close()
        s.stop()


def test_an_engine_without_room_for_staging_receives_in_place(qwen2_dir, hf_models):
    """--staging-memory-limit-mb below the model's size: the push is received straight into the
    weights, the engines paused for the transfer, and lands exactly."""
    s = Sidecar(qwen2_dir, "--staging-memory-limit-mb", "1")
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync(bucket_bytes=1 << 20)
        load = threading.Thread(target=_requests_finished_meanwhile, args=(client, 2.0))
        load.start()
        new = _perturbed(hf_models["qwen2"], 9)
        client.push_weights(new, version=1)
        load.join()
        stats = client.stats()
        assert stats["inplace_pushes"] == 1 and stats["version"] == 1 and stats["engine_restarts"] == 0
        assert client.weights_checksums() == [weights_checksum(new.named_parameters())]
        prompt = [9, 10, 11]
        got = client.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0][0]
        assert got.token_ids == hf_greedy(new, prompt, 8, ignore_eos=True)
    finally:
        client.close()
        s.stop()


def test_an_in_place_push_whose_trainer_dies_restarts_the_engine_with_the_old_weights(qwen2_dir, hf_models):
    """The price of receiving in place: weights torn half way cannot serve, so the engine is
    restarted and serves the last committed weights again (here the checkpoint's)."""
    s = Sidecar(qwen2_dir, "--staging-memory-limit-mb", "1", "--push-stall-timeout", "3")
    client = RolloutClient(s.url, token=TOKEN)
    trainer = _trainer(s, qwen2_dir, 3600)
    try:
        prompt = [9, 10, 11]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert json.loads(trainer.stdout.readline()) == {"at": 3}
        time.sleep(1.0)  # the worker writes the buckets already sent (a kill resets the connection: unread ones go)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        _wait_healthy(client)
        deadline = time.monotonic() + 90  # as _wait_healthy: a restart on 2 loaded cores can take tens of seconds
        while client.stats()["engine_restarts"] == 0:
            assert time.monotonic() < deadline, "the engine with torn weights was not restarted"
            time.sleep(0.2)
        _wait_healthy(client)
        stats = client.stats()
        assert stats["failed_pushes"] == 1 and stats["version"] == 0 and stats["inplace_pushes"] == 1
        assert client.weights_checksums() == [weights_checksum(hf_models["qwen2"].named_parameters())]
        assert client.generate([prompt], params)[0][0].token_ids == hf_greedy(hf_models["qwen2"], prompt, 8,
                                                                              ignore_eos=True)
    finally:
        trainer.kill()
        trainer.wait()
        client.close()
        s.stop()
