"""One trainer owns a sidecar's weight sync (issue 18, item 4): a second trainer's init is refused
while the first lives and has not closed, unless it takes over; the evicted trainer's pushes are
refused at once (not a 30 s stall); versions only go up."""

import copy
import os
import subprocess
import sys
import time

import pytest

from engine import SamplingParams
from rollout import RolloutClient, SidecarError
from tests.engine.helpers import hf_greedy
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_sidecar import perturb

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    s = Sidecar(qwen2_dir)
    yield s
    s.stop()


@pytest.fixture()
def trainer(hf_models):
    return copy.deepcopy(hf_models["qwen2"])


def _version(client):
    return client.health()["version"]


def _greedy(client):
    return client.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0][0]


def test_a_refused_trainer_that_closes_its_weight_sync_leaves_the_owners_group_alone(sidecar, trainer):
    """b's init is refused (a owns the sidecar); b closing its weight sync (as a trainer's cleanup
    does, and as a peer's catch-up does after a refused init) closes nothing of a's: a's group
    still carries its next push, with no new group formed."""
    a, b = RolloutClient(sidecar.url, token=TOKEN), RolloutClient(sidecar.url, token=TOKEN)
    try:
        info = a.init_weight_sync()
        with pytest.raises(SidecarError, match="another trainer owns"):
            b.init_weight_sync()
        b.close_weight_sync()
        assert a.health()["weight_sync_owner"]["group_name"] == info["group_name"]
        v = _version(a) + 1
        a.push_weights(trainer, version=v)
        assert a.health()["weight_sync_owner"]["group_name"] == info["group_name"]  # no regroup was needed
        assert _version(a) == v
        a.close_weight_sync()
    finally:
        a.close()
        b.close()


def test_a_second_trainer_is_refused_until_it_takes_over(sidecar, trainer):
    a, b = RolloutClient(sidecar.url, token=TOKEN), RolloutClient(sidecar.url, token=TOKEN)
    try:
        a.init_weight_sync()
        t0 = time.monotonic()
        with pytest.raises(SidecarError, match="another trainer owns") as e:
            b.init_weight_sync()
        assert e.value.kind == "refused" and time.monotonic() - t0 < 10
        v = _version(a) + 1
        a.push_weights(trainer, version=v)  # the owner is untouched
        perturb(trainer, 1)
        b.init_weight_sync(take_over=True)
        t0 = time.monotonic()
        with pytest.raises(SidecarError, match="another trainer took over"):
            a.push_weights(trainer, version=v + 1)
        assert time.monotonic() - t0 < 10  # refused before any pause, not after the group's timeout
        b.push_weights(trainer, version=v + 1)
        assert _version(b) == v + 1 and _greedy(b).token_ids == hf_greedy(trainer, [9, 10, 11], 8, True)
        b.close_weight_sync()
        a.init_weight_sync()  # the owner closed its group: no take_over needed
    finally:
        a.close()
        b.close()


def test_versions_only_go_up_and_a_refused_push_changes_nothing(sidecar, trainer):
    client = RolloutClient(sidecar.url, token=TOKEN)
    try:
        client.init_weight_sync(take_over=True)
        v = _version(client) + 1
        client.push_weights(trainer, version=v)
        sums = client.weights_checksums()
        perturb(trainer, 2)
        for stale in (v, v - 1):
            with pytest.raises(SidecarError, match="does not go up") as e:
                client.push_weights(trainer, version=stale)
            assert e.value.kind == "refused"
        assert client.weights_checksums() == sums and _version(client) == v
        client.push_weights(trainer, version=v + 1)
        assert client.weights_checksums() != sums and _version(client) == v + 1
    finally:
        client.close()


OWNER = r"""
import sys, time
from rollout import RolloutClient
client = RolloutClient(sys.argv[1], token=sys.argv[2])
client.init_weight_sync(take_over=True)
print("owner", flush=True)
time.sleep(3600)
"""


def test_a_dead_owner_frees_the_sidecar(sidecar, trainer):
    proc = subprocess.Popen([sys.executable, "-c", OWNER, sidecar.url, TOKEN], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    client = RolloutClient(sidecar.url, token=TOKEN)
    try:
        assert proc.stdout.readline().strip() == "owner"
        with pytest.raises(SidecarError, match="another trainer owns"):
            client.init_weight_sync()
        proc.kill()
        proc.wait()
        client.init_weight_sync()  # its rendezvous port refuses now: the group has no trainer
        client.push_weights(trainer, version=_version(client) + 1)
    finally:
        proc.kill()
        client.close()
