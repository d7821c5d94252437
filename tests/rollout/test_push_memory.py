"""No memory left behind by failed pushes (issue 26, item 3.1): a push given up mid-transfer gives
its staging copy back at once, so trainers SIGKILLed mid-push one after another never pile up
staging copies in the sidecar's engine core. Real sidecar, real trainer processes, gloo."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from rollout import RolloutClient
from tests.rollout.sidecar import TOKEN, Sidecar

pytestmark = pytest.mark.timeout(180)

LAYERS = 12  # the tiny model's width, deeper: ~40 MB of fp32 weights, a staging copy far above RSS noise

# A trainer that pushes its weights (x1.5) to the sidecar whose address it reads on stdin (it starts
# before the sidecar is up), and stops dead at bucket 3: the test SIGKILLs it there.
TRAINER = r"""
import json, sys, time
from safetensors.torch import load_file
from rollout import RolloutClient
token, weights = sys.argv[1:3]
named = [(n, t * 1.5) for n, t in load_file(weights).items()]
client = RolloutClient(sys.stdin.readline().strip(), token=token)
client.init_weight_sync(bucket_bytes=1 << 20, take_over=True)
def stop_dead(k, n):
    if k == 3:
        print(json.dumps({"at": k}), flush=True)
        time.sleep(3600)
client.push_weights(named, version=7, progress=stop_dead)
"""


@pytest.fixture(scope="module")
def deep_model(qwen2_dir, tmp_path_factory) -> str:
    """The tiny Qwen2 (tokenizer and all) with LAYERS layers of fresh seeded weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("deep") / "qwen2"
    shutil.copytree(qwen2_dir, out)
    cfg = AutoConfig.from_pretrained(qwen2_dir)
    cfg.num_hidden_layers = LAYERS
    cfg.layer_types = cfg.layer_types[:1] * LAYERS  # every layer as the tiny model's (full attention)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return str(out)


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))  # tied weights stored once


def _core_rss(client) -> int:
    """Bytes resident in the sidecar's engine-core processes, from /proc."""
    total = 0
    for state in client.health()["engine_states"]:
        with open(f"/proc/{state['pid']}/status") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return total


def _trainer(model_dir: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, TOKEN, os.path.join(model_dir, "model.safetensors")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})


def _kill_mid_push(trainer: subprocess.Popen, sidecar, client) -> None:
    """The trainer pushes to the sidecar and is SIGKILLed mid-transfer; returns once the sidecar
    gave the push up."""
    failed = client.stats()["failed_pushes"]
    trainer.stdin.write(sidecar.url + "\n")
    trainer.stdin.flush()
    assert json.loads(trainer.stdout.readline()) == {"at": 3}
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 20
    while client.stats()["failed_pushes"] == failed:
        assert time.monotonic() < deadline, "the push of a dead trainer was never given up"
        time.sleep(0.1)


def test_trainers_killed_mid_push_leave_no_staging_copy_behind(deep_model):
    weights = _weights(deep_model)
    staging = sum(t.numel() * t.element_size() for t in weights.values())  # one staging copy: the pushed bytes
    trainers = [_trainer(deep_model) for _ in range(3)]  # they start while the sidecar does
    s = client = None
    try:
        s = Sidecar(deep_model)
        client = RolloutClient(s.url, token=TOKEN)
        client.init_weight_sync()
        for v in (1, 2):  # steady state: the weights and the staging buffer kept for the next push
            client.push_weights([(n, t + v) for n, t in weights.items()], version=v)
        start = _core_rss(client)
        for trainer in trainers:
            _kill_mid_push(trainer, s, client)
        grown = _core_rss(client) - start
        assert grown < staging, (f"{grown / 2**20:.1f} MiB more after 3 killed pushes (a staging copy is "
                                 f"{staging / 2**20:.1f} MiB)")
        new = [(n, t * 0.5) for n, t in weights.items()]
        client.init_weight_sync()
        client.push_weights(new, version=8)
        assert client.weights_checksums() == [client.checksum_of(new)]
        # what the push retired is freed as the core gets to it: give it a few seconds (a leak never falls back)
        deadline = time.monotonic() + 5
        while _core_rss(client) - start >= staging and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _core_rss(client) - start < staging
    finally:
        for trainer in trainers:
            trainer.kill()
            trainer.wait()
        if client is not None:
            client.close()
        if s is not None:
            s.stop()
