"""Sidecars on three emulated hosts (bench.hostbed: network namespaces on a bridge, links shaped to
100 Mbit/s), the trainer on the bridge: the weight-sync group forms across hosts whatever this
machine's hostname resolves to (here 127.0.0.1), and a push lands on every host."""

import copy

import pytest
import torch

from engine import SamplingParams
from rollout import RolloutClient
from tests.engine.helpers import hf_greedy, random_prompts
from tests.hosts.conftest import HOSTS
from tests.rollout.in_flight import held, wait_decoding, wait_stats
from tests.rollout.sidecar import TOKEN
from tests.rollout.test_sidecar import perturb
from weight_sync import weights_checksum

pytestmark = pytest.mark.timeout(300)


def test_a_push_to_three_hosts_lands_on_every_host(bed, host_sidecars, hf_models):
    client = RolloutClient([host_sidecars[h].url for h in HOSTS], token=TOKEN)
    try:
        info = client.init_weight_sync(host=bed.gateway)  # the trainer's address on the bed
        assert info["world_size"] == 1 + len(HOSTS)
        trainer = copy.deepcopy(hf_models["qwen2"])
        perturb(trainer, 21, scale=0.05)
        out = client.push_weights(trainer, version=1, delta=True)  # full (no base yet), kept as the next one's base
        assert out["version"] == 1 and not out["delta"]
        assert client.weights_checksums() == [weights_checksum(trainer.named_parameters())] * len(HOSTS)
        prompts = random_prompts(3, 4, 12, 2000, seed=83)
        groups = client.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [g[0].token_ids for g in groups] == [hf_greedy(trainer, p, 8, ignore_eos=True) for p in prompts]
        assert all(g[0].weight_versions == [1] * 8 for g in groups)
        # a delta (forced: these engines are fp32) rides the same chain across the hosts
        g = torch.Generator().manual_seed(22)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02 * (torch.rand(p.shape, generator=g) < 0.03))
        out = client.push_weights(trainer, version=2, delta=True)
        assert out["delta"] and out["trainer"]["bytes"] < 0.25 * out["trainer"]["full_bytes"]
        assert client.weights_checksums() == [weights_checksum(trainer.named_parameters())] * len(HOSTS)
    finally:
        client.close()


def test_a_loopback_interface_for_peers_on_other_hosts_is_refused_with_the_fix(monkeypatch, bed):
    """GLOO_SOCKET_IFNAME=lo would make this rank advertise 127.0.0.1 to peers on other hosts."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    from weight_sync.common.hosts import gloo_device
    from weight_sync.common.votes import WeightSyncError

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with pytest.raises(WeightSyncError, match="interface that reaches"):
        gloo_device(ProcessGroupGloo, bed.gateway)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert gloo_device(ProcessGroupGloo, bed.gateway) is not None  # the bridge's own address


def test_a_host_whose_link_goes_down_mid_push_costs_that_host_only(bed, host_sidecars, hf_models):
    """h3's link taken down while a push's buckets cross it: no reset, no close, its packets just
    stop. The client drops h3 when its heartbeats go unanswered, the trainer stops sending, the
    push commits on h1 and h2 on the next try, and h3's sidecar, back on its link, still serves
    what it served (nothing of the broken push was committed there)."""
    import threading
    import time

    client = RolloutClient([host_sidecars[h].url for h in HOSTS], token=TOKEN)
    h3 = None
    try:
        client.init_weight_sync(host=bed.gateway, bucket_bytes=2 * 1024 * 1024, take_over=True)
        version = client.stats()[0]["version"]
        h3_before = client.weights_checksums()[2]
        trainer = copy.deepcopy(hf_models["qwen2"])
        perturb(trainer, 24, scale=0.05)
        down = threading.Event()

        def progress(k, n):
            if k == 3 and not down.is_set():
                down.set()
                bed.link("h3", False)

        t0 = time.monotonic()
        try:
            out = client.push_weights(trainer, version=version + 1, progress=progress)
        finally:
            took = time.monotonic() - t0
            bed.link("h3", True)
        assert down.is_set() and out["version"] == version + 1
        assert client.urls == [host_sidecars["h1"].url, host_sidecars["h2"].url]
        bound = bed.link_bound_s(sum(p.numel() * 4 for p in trainer.parameters()))
        # the client's heartbeat timeout (10 s) finds h3 gone; then the push again without it
        assert took < 3 * bound + 10 + 30, took
        want = weights_checksum(trainer.named_parameters())
        assert client.weights_checksums() == [want] * 2
        h3 = RolloutClient(host_sidecars["h3"].url, token=TOKEN)  # a client of its own: this one dropped it
        deadline = time.monotonic() + 200  # h3's own part ends when it finds the trainer stalled
        while h3.health()["pushing"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert h3.weights_checksums() == [h3_before] and h3.stats()["version"] == version
    finally:
        if h3 is not None:
            h3.close()
        client.close()


def test_a_host_killed_mid_push_costs_that_host_only(bed, host_sidecars, hf_models):
    """h2 (the middle of the chain) SIGKILLed while a push's buckets cross the links: the push
    ends for the others within seconds, committed on h1 and h3 (the client drops h2 and sends
    once more without it), and the next push lands there too. Last in the module: h2 stays dead."""
    import threading
    import time

    from tests.hosts.conftest import RATE_MBIT

    client = RolloutClient([host_sidecars[h].url for h in HOSTS], token=TOKEN)
    try:
        client.init_weight_sync(host=bed.gateway, bucket_bytes=2 * 1024 * 1024, take_over=True)
        version = client.stats()[0]["version"]
        trainer = copy.deepcopy(hf_models["qwen2"])
        perturb(trainer, 22, scale=0.05)
        killed = threading.Event()

        def progress(k, n):  # bucket 3 of 8 posted: the bytes are on the links
            if k == 3 and not killed.is_set():
                killed.set()
                bed.kill_host("h2")

        t0 = time.monotonic()
        out = client.push_weights(trainer, version=version + 1, progress=progress)
        took = time.monotonic() - t0
        assert killed.is_set() and out["version"] == version + 1
        bound = sum(p.numel() * 4 for p in trainer.parameters()) * 8 / (RATE_MBIT * 1e6)
        # the broken push, then the push again: seconds (1.7 s idle, 1.2 s of it the link), never the
        # group's timeout (120 s, what the trainer waited before the link to a worker that stops reading was closed)
        assert took < 3 * bound + 30, took
        want = weights_checksum(trainer.named_parameters())
        assert client.weights_checksums() == [want] * 2  # h1 and h3
        perturb(trainer, 23, scale=0.05)
        client.push_weights(trainer, version=version + 2)
        assert client.weights_checksums() == [weights_checksum(trainer.named_parameters())] * 2
    finally:
        client.close()


def _pushed_last(hf_models):
    """The weights the kill test pushed last (its perturbations, replayed)."""
    trainer = copy.deepcopy(hf_models["qwen2"])
    perturb(trainer, 22, scale=0.05)
    perturb(trainer, 23, scale=0.05)
    return trainer


@pytest.fixture(scope="module")
def returned(bed, qwen2_dir):
    """A sidecar on h2 again, once the kill test took h2 down: it holds its checkpoint."""
    from tests.hosts.conftest import SIDECAR_ARGS

    side = bed.sidecar("h2", qwen2_dir, *SIDECAR_ARGS, token=TOKEN)
    yield side
    side.stop()


def test_a_returning_host_is_caught_up_from_a_peer_without_a_push(bed, host_sidecars, returned, hf_models):
    """h2, killed by the test before, comes back (a new sidecar on it, holding its checkpoint) and
    is added: h1 sends it the newest committed weights over their two links, with no push and
    nothing from the trainer; it then serves them: their version, the trainer's checksums, greedy
    tokens equal to HF's on them."""
    import time

    trainer = _pushed_last(hf_models)
    want = weights_checksum(trainer.named_parameters())
    client = RolloutClient([host_sidecars[h].url for h in ("h1", "h3")], token=TOKEN)
    solo = RolloutClient(returned.url, token=TOKEN)
    try:
        version = client.stats()[0]["version"]
        assert version > 0 and solo.stats()["version"] == 0 and solo.weights_checksums() != [want]
        t0 = time.monotonic()
        client.add_sidecar(returned.url, wait=True)
        took = time.monotonic() - t0
        assert client.states == {host_sidecars["h1"].url: "active", host_sidecars["h3"].url: "active",
                                 returned.url: "active"}
        assert solo.stats()["version"] == version and solo.weights_checksums() == [want]
        # one model over h1's link and h2's (14.7 MB at 100 Mbit/s: 1.2 s), plus the group's forming
        assert took < 3 * bed.link_bound_s(sum(p.numel() * 4 for p in trainer.parameters())) + 30, took
        prompts = random_prompts(3, 4, 12, 2000, seed=84)
        groups = solo.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [g[0].token_ids for g in groups] == [hf_greedy(trainer, p, 8, ignore_eos=True) for p in prompts]
        assert all(g[0].weight_versions == [version] * 8 for g in groups)
    finally:
        solo.close()
        client.close()


def test_a_host_lost_mid_generate_costs_no_rollout(bed, host_sidecars, returned, hf_models):
    """h2 (back and caught up) loses power while it generates its share of a call spread over
    three hosts: its unfinished samples go on, from their tokens so far, on h1 and h3, and every
    rollout comes back whole, greedy as HF's."""
    import concurrent.futures

    trainer = _pushed_last(hf_models)
    urls = [host_sidecars["h1"].url, host_sidecars["h3"].url, returned.url]
    client = RolloutClient(urls, token=TOKEN)
    solo = RolloutClient(returned.url, token=TOKEN)
    try:
        prompts = random_prompts(12, 5, 20, 2000, seed=85)
        params = SamplingParams(n=2, temperature=0, max_tokens=64, ignore_eos=True)
        core, before = solo.health()["engine_states"][0]["pid"], solo.stats()["rollouts"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with held([core]):  # h2's share (4 prompts, n=2) cannot finish while it arrives
                pending = pool.submit(client.generate, prompts, params)
                wait_stats(solo, lambda s: s["queue_depth"] == 8, "h2 never got its share")
            wait_decoding(solo, 8)
            with held([core]):  # what h2 finished, read while it cannot finish more, until it is lost
                finished = solo.stats()["rollouts"] - before - 1  # (the marker's rollout aside)
                bed.kill_host("h2")
            groups = pending.result(timeout=240)
        assert finished < 8, "h2 finished its share (4 prompts, n=2) before it was lost"
        assert all(len(g) == 2 and all(len(r.token_ids) == 64 for r in g) for g in groups)
        for p, g in zip(prompts[8:], groups[8:]):  # h2's share: the last third
            assert [r.token_ids for r in g] == [hf_greedy(trainer, p, 64, ignore_eos=True)] * 2
        assert client.urls == urls[:2]
    finally:
        solo.close()
        client.close()


def test_a_peer_lost_while_it_catches_a_sidecar_up_is_replaced_by_another(bed, host_sidecars, qwen2_dir):
    """A newcomer on h2 (a second sidecar there) is being sent the weights by h1 when h1 loses
    power: the client drops h1, the newcomer's half-received push changes nothing, and h3 sends
    the weights instead; the newcomer serves them (version, checksums). Last: h1 stays dead.
    h1's link is slowed to 8 Mbit/s (the push takes ~15 s, not 1.2) so that the kill lands
    mid-push by construction: a late health answer on loaded cores once found it committed."""
    import time

    from tests.hosts.conftest import SIDECAR_ARGS

    client = RolloutClient([host_sidecars[h].url for h in ("h1", "h3")], token=TOKEN)
    newcomer = bed.sidecar("h2", qwen2_dir, *SIDECAR_ARGS, token=TOKEN)
    solo = RolloutClient(newcomer.url, token=TOKEN)
    try:
        version = client.stats()[0]["version"]
        want = client.weights_checksums()[1]  # h3's
        bed.rate("h1", 8)
        client.add_sidecar(newcomer.url)  # h1, the first active sidecar, is asked to send
        deadline = time.monotonic() + 60
        while not solo.health()["pushing"] and time.monotonic() < deadline:
            time.sleep(0.05)
        bed.kill_host("h1")  # h1's push to the newcomer has begun
        deadline = time.monotonic() + 120
        while solo.stats()["version"] != version and time.monotonic() < deadline:
            client.health()  # this client's loop runs in its calls: there it asks h3 once h1 is gone
            time.sleep(0.2)
        assert client.urls == [host_sidecars["h3"].url, newcomer.url]
        assert solo.stats()["version"] == version and solo.weights_checksums() == [want]
        stats = solo.stats()
        assert stats["pushes"] == 1 and stats["failed_pushes"] == 1  # h3's committed; h1's did not
    finally:
        solo.close()
        client.close()
        newcomer.stop()
        bed.rate("h1", bed.rate_mbit)
