"""Weight pushes into vLLM (`rollout.serve --engine vllm`): our receiver in vLLM's worker, the real
sidecar, the real client, a real trainer process; gloo on CPU, vLLM's CPU build, fp32. One sidecar
of one vLLM engine for the module (a vLLM start is about a minute of CPU on 2 cores)."""

import copy
import json
import os
import signal
import time

import pytest
import torch

pytest.importorskip("vllm")

from rollout import SidecarError  # noqa: E402
from tests.engine.helpers import random_prompts  # noqa: E402
from tests.rollout.sidecar import TOKEN, Sidecar  # noqa: E402
from tests.rollout.test_overlap import _requests_finished_meanwhile, _trainer  # noqa: E402
from tests.rollout.test_sidecar import perturb  # noqa: E402
from tests.vllm.conftest import GREEDY, greedy, hf_greedy_all  # noqa: E402
from weight_sync import weights_checksum  # noqa: E402

pytestmark = pytest.mark.timeout(300)
PROMPTS = random_prompts(4, 4, 20, 2000, seed=77)


def _pushed(hf_models):
    """The weights the first test pushes."""
    model = copy.deepcopy(hf_models["qwen2"])
    perturb(model, 5, scale=0.05)
    return model


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    s = Sidecar(qwen2_dir, "--engine", "vllm", "--host-copy", "off", "--http-port", "0",
                "--weight-transfer-routes")  # vLLM's RL routes too (the last test)
    yield s
    s.stop()


def test_a_push_serves_the_pushed_weights_as_hf_does(client, trainer, hf_models):
    """vLLM's loaders, fed by our receiver, leave the engine serving what a checkpoint of the pushed
    weights gives: its digest, and HF's greedy tokens (vLLM fp32 on the checkpoint gives HF's:
    test_vllm_sidecar.py)."""
    before = greedy(client, PROMPTS)
    assert client.init_weight_sync(take_over=True)
    assert client.weights_checksums() == [weights_checksum(trainer.named_parameters())]  # the checkpoint's
    trainer.load_state_dict(_pushed(hf_models).state_dict())
    version = client.stats()["version"] + 1
    client.push_weights(trainer, version=version)
    assert client.weights_checksums() == [client._client.sender.checksum(trainer)]
    after = client.generate(PROMPTS, GREEDY)
    assert [g[0].token_ids for g in after] != before  # the push changed what comes out
    assert all(g[0].weight_versions == [version] * 12 for g in after)
    assert [g[0].token_ids for g in after] == hf_greedy_all(trainer, PROMPTS)


def test_bad_manifests_change_nothing_and_the_next_push_lands(client, trainer):
    client.init_weight_sync(take_over=True)
    before, version = greedy(client, PROMPTS), client.stats()["version"]
    state = trainer.state_dict()
    unknown = list(state.items()) + [("model.layers.0.mlp.extra.weight", torch.zeros(4))]
    wrong_shape = [(n, t[:-1] if n.endswith("input_layernorm.weight") else t) for n, t in state.items()]
    wrong_dtype = [(n, t.to(torch.int32) if n.endswith("norm.weight") else t) for n, t in state.items()]
    for bad, why in ((unknown, "unknown names"), (wrong_shape, "wrong shapes"), (wrong_dtype, "dtypes")):
        with pytest.raises(SidecarError, match=why):
            client.push_weights(bad, version=version + 1)
        assert client.stats()["version"] == version
    assert greedy(client, PROMPTS) == before
    perturb(trainer, 6)
    client.push_weights(trainer, version=version + 1)
    assert client.stats()["version"] == version + 1
    assert client.weights_checksums() == [client._client.sender.checksum(trainer)]
    assert greedy(client, PROMPTS) == hf_greedy_all(trainer, PROMPTS)


def test_a_trainer_killed_mid_push_costs_that_push_only(sidecar, client, trainer, qwen2_dir):
    before, failed, version = greedy(client, PROMPTS), client.stats()["failed_pushes"], client.stats()["version"]
    assert version < 7  # the killed trainer pushes version 7
    dead = _trainer(sidecar, qwen2_dir, 3600)
    try:
        assert json.loads(dead.stdout.readline()) == {"at": 3}
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
        deadline = time.monotonic() + 30
        while client.stats()["failed_pushes"] == failed:
            assert time.monotonic() < deadline, "the dead trainer's push was never given up"
            time.sleep(0.2)
        assert greedy(client, PROMPTS) == before and client.stats()["version"] == version
    finally:
        dead.kill()
        dead.wait()
    client.init_weight_sync()
    perturb(trainer, 7)
    client.push_weights(trainer, version=version + 1)
    assert client.weights_checksums() == [client._client.sender.checksum(trainer)]
    assert greedy(client, PROMPTS) == hf_greedy_all(trainer, PROMPTS)


def test_an_overlapped_push_pauses_for_the_commit_only(sidecar, client, qwen2_dir):
    """A transfer held up 3 s at bucket 3: vLLM keeps serving while the bytes arrive."""
    paused = client.stats()["pause_seconds"]
    trainer = _trainer(sidecar, qwen2_dir, 3)
    try:
        assert json.loads(trainer.stdout.readline()) == {"at": 3}
        served = _requests_finished_meanwhile(client, 1.5)
        assert json.loads(trainer.stdout.readline()) == {"done": 7}
        assert served > 3
        assert client.stats()["version"] == 7
        assert client.stats()["pause_seconds"] - paused < 1.0  # vLLM's reload, not the 3 s transfer
    finally:
        trainer.kill()
        trainer.wait()


def test_a_delta_into_vllm_gives_what_the_full_push_gives(client, trainer):
    """A delta (forced: in fp32 it pays only when few elements move) goes through vLLM's loaders
    from the copy of the weights its receiver keeps, bit for bit the full push's."""
    client.init_weight_sync(take_over=True)
    version = client.stats()["version"]
    assert not client.push_weights(trainer, version=version + 1, delta=True)["delta"]  # the base, in full
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in trainer.parameters():  # a step that moves 3% of the elements
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * (torch.rand(p.shape, generator=g) < 0.03))
    out = client.push_weights(trainer, version=version + 2, delta=True)
    assert out["delta"] and out["trainer"]["bytes"] < 0.25 * out["trainer"]["full_bytes"]
    want = client._client.sender.checksum(trainer)
    assert client.weights_checksums() == [want]
    by_delta = greedy(client, PROMPTS)
    assert not client.push_weights(trainer, version=version + 3, delta=False)["delta"]
    assert client.weights_checksums() == [want] and greedy(client, PROMPTS) == by_delta


def test_vllms_trainer_code_pushes_into_vllms_engine_through_the_rl_routes(sidecar, client, qwen2_dir):
    """vLLM's RL routes (rollout/sidecar/vllm_transfer.py) on `--engine vllm`: vLLM's own trainer code
    (tests/rl_routes/vllm_trainer.py) pushes into vLLM's loaders; a wrong shape changes nothing."""
    import subprocess
    import sys

    import httpx

    from tests.rl_routes.vllm_trainer import perturbed as trained, push_here

    client.close_weight_sync()  # this module's client owns the weight sync until it lets go (else a 409)
    before, version = client.weights_checksums(), client.stats()["version"]
    out = subprocess.run([sys.executable, "-m", "tests.rl_routes.vllm_trainer", "--url", sidecar.http_url,
                          "--model", qwen2_dir, "--wrong-shape", "--token", TOKEN], capture_output=True, text=True,
                         timeout=200)
    assert out.returncode == 1 and "wrong shapes" in out.stdout, out.stderr[-2000:]
    assert client.weights_checksums() == before and client.stats()["version"] == version
    first = greedy(client, PROMPTS[:1])
    push_here(sidecar.http_url, qwen2_dir, seed=7, version=str(version + 3), token=TOKEN)
    assert client.weights_checksums() == [weights_checksum(trained(qwen2_dir, 7).named_parameters())]
    info = httpx.get(sidecar.http_url + "/weight_info", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert info == {"weight_version": str(version + 3)}
    [[r]] = client.generate(PROMPTS[:1], GREEDY)
    assert r.weight_versions == [version + 3] * len(r.token_ids) and [r.token_ids] != first
