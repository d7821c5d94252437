"""A real sidecar with --num-engines 2: load spread over both, pushes and safetensors loads reach
both, and health names an engine that died."""

import copy
import os
import signal
import time

import pytest
import torch

from engine import SamplingParams
from rollout import RolloutClient, SidecarError
from tests.engine.helpers import hf_greedy, random_prompts
from tests.procs import descendants
from tests.rollout.sidecar import TOKEN, Sidecar
from weight_sync import weights_checksum
from weight_sync.trainer.file_push import write_safetensors

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    s = Sidecar(qwen2_dir, "--num-engines", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(sidecar):
    c = RolloutClient(sidecar.url, token=TOKEN)
    yield c
    c.close()


@pytest.fixture(scope="module")
def trainer(hf_models):
    return copy.deepcopy(hf_models["qwen2"])


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def test_groups_spread_over_both_engines(client):
    before = client.stats()["requests_per_engine"]
    client.generate(random_prompts(16, 5, 20, 2000, seed=90), SamplingParams(n=2, max_tokens=16, ignore_eos=True))
    after = client.stats()["requests_per_engine"]
    spread = [a - b for a, b in zip(after, before)]
    assert sum(spread) == 16 and min(spread) >= 4, spread  # least loaded first: both take a share
    health = client.health()
    assert health["ok"] and health["engines"] == 2 and [s["state"] for s in health["engine_states"]] == ["live"] * 2


def test_a_push_reaches_both_engines(client, trainer):
    client.init_weight_sync()
    _perturb(trainer, 1)
    version = client.stats()["version"] + 1
    client.push_weights(trainer, version=version)
    want = weights_checksum(trainer.named_parameters())
    assert client.weights_checksums() == [want, want]
    prompts = random_prompts(8, 5, 20, 2000, seed=91)
    groups = client.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for p, g in zip(prompts, groups):
        assert g[0].token_ids == hf_greedy(trainer, p, 8, ignore_eos=True) and g[0].weight_versions == [version] * 8
    assert [s["version"] for s in client.health()["engine_states"]] == [version, version]


def test_safetensors_load_reaches_both_engines_and_a_bad_one_changes_nothing(client, trainer, tmp_path):
    _perturb(trainer, 2)
    version = client.stats()["version"] + 1
    write_safetensors(trainer, tmp_path / "good", version)
    client.load_weights(str(tmp_path / "good"), version)
    want = weights_checksum(trainer.named_parameters())
    assert client.weights_checksums() == [want, want] and client.stats()["version"] == version
    prompt = [9, 10, 11]
    assert client.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0][0].token_ids \
        == hf_greedy(trainer, prompt, 6, ignore_eos=True)
    # a directory with no push, and a push of other shapes: refused, nothing changed
    with pytest.raises(SidecarError, match="no complete push"):
        client.load_weights(str(tmp_path / "missing"), version + 1)
    bad = [(n, t[:-1] if n.endswith("norm.weight") else t) for n, t in trainer.state_dict().items()]
    write_safetensors(bad, tmp_path / "bad", version + 1)
    with pytest.raises(SidecarError, match="refused"):
        client.load_weights(str(tmp_path / "bad"), version + 1)
    assert client.weights_checksums() == [want, want] and client.stats()["version"] == version


def test_a_shared_memory_push_needs_no_group(client, trainer):
    """transport="shared": both engines read the trainer's /dev/shm buffer; no process group."""
    from weight_sync import flatten_parameters

    shared = copy.deepcopy(trainer)
    flatten_parameters(shared, shared=True)
    _perturb(shared, 3)
    client.close_weight_sync()  # no group at all from here on
    version = client.stats()["version"] + 1
    client.push_weights(shared, version=version, transport="shared")
    want = weights_checksum(shared.named_parameters())
    assert client.weights_checksums() == [want, want] and client.stats()["version"] == version
    with pytest.raises(ValueError, match="shared=True"):
        client.push_weights(trainer, version=version + 1, transport="shared")  # not in shared memory


def test_sleep_and_wake_up_for_a_trainer_that_shares_the_gpu(client):
    client.sleep(1)
    health = client.health()
    assert not health["ok"] and all("KV cache" in e["reason"] for e in health["engine_states"])
    client.wake_up()
    assert client.health()["ok"]
    assert len(client.generate([[5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))[0][0].token_ids) == 4


def test_health_names_an_engine_that_died(sidecar, client):
    """An engine core killed: health says so at once (the engine is then restarted, see
    test_engine_faults.py)."""
    cores = [s["pid"] for s in client.health()["engine_states"]]
    assert len(cores) == 2 and all(p in descendants(sidecar.proc.pid) for p in cores)
    os.kill(cores[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (health := client.health())["ok"]:
        assert time.monotonic() < deadline, "health still ok 10 s after an engine core was killed"
        time.sleep(0.1)
    assert health["engines"] == 1 and "died" in health["reason"]
    states = health["engine_states"]
    assert sum(s["state"] == "live" for s in states) == 1
    (down,) = [s for s in states if s["state"] != "live"]
    assert down["state"] == "restarting" and "died" in down["reason"]
