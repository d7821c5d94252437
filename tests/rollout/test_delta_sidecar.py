"""Delta pushes through a real sidecar serving bf16 (weight_sync/common/delta_push.py): the client sends
deltas once the sidecar holds its last push, and the full weights when it may not (a healed
engine, engines back on the checkpoint); the weights equal the trainer's after every push, and an
engine healed from the host copy after a chain of deltas holds them exactly."""

import copy
import os
import signal

import pytest
import torch

from rollout import RolloutClient
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_engine_faults import _cores, _wait_healthy, _wait_host_copy

pytestmark = pytest.mark.timeout(300)


def _step(model, seed, frac=0.03):
    """An optimizer step's shape: a few percent of the elements move."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01 * (torch.rand(p.shape, generator=g) < frac))


def test_deltas_through_a_sidecar_stay_exact_across_a_heal_and_a_reload(qwen2_dir, hf_models):
    sidecar = Sidecar(qwen2_dir, "--num-engines", "1", "--host-copy", "on", "--dtype", "bfloat16")
    client = RolloutClient(sidecar.url, token=TOKEN)
    trainer = copy.deepcopy(hf_models["qwen2"])

    def push(version, **kw) -> dict:
        out = client.push_weights(trainer, version=version, **kw)
        assert client.weights_checksums() == [client.checksum_of(trainer)]  # bf16: what the trainer sent
        return out

    try:
        client.init_weight_sync()
        assert not push(1)["delta"]  # nothing kept yet: the full weights
        for v in (2, 3):
            _step(trainer, v)
            # delta=True: left to the client, a delta that took longer than the full push (loaded cores)
            # turns the next push full (DeltaAnchors.auto), and CI once saw v3 go full so
            out = push(v, delta=True)
            assert out["delta"] and out["trainer"]["bytes"] < 0.25 * out["trainer"]["full_bytes"]

        # the engine dies; it comes back from the host copy written after the deltas, exactly
        _wait_host_copy(client, 3)
        [core] = _cores(client)
        os.kill(core, signal.SIGKILL)
        _wait_healthy(client)
        assert client.stats()["last_restart"]["source"] == "host copy"
        assert client.weights_checksums() == [client.checksum_of(trainer)]
        _step(trainer, 4)
        assert not push(4)["delta"]  # a healed sidecar gets the full weights (a new group)
        _step(trainer, 5)
        assert push(5, delta=True)["delta"]  # a delta again (forced, it would go full without the base)

        # the engines go back to the checkpoint's weights mid-chain: the delta is refused before any
        # byte moves and the same push goes in full
        client.sleep(level=2)
        client.wake_up()
        _step(trainer, 6)
        assert not push(6)["delta"]
        _step(trainer, 7)
        assert push(7, delta=True)["delta"]
        assert not push(8, delta=False)["delta"]  # off: the full weights, and no copy kept
        assert client._client.sender.kept is None
    finally:
        client.close()
        sidecar.stop()
