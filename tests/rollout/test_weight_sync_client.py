"""The trainer's half of a push on its own (rollout.client.weight_sync_client.WeightSyncClient): its
decisions when a push is refused, torn, loses a member or regroups, and when it sends deltas. No
sidecar process: the links (rollout.client.push_links.PushLinks) are scripted here, and each "sidecar"
behind them is one worker of this process, a real PushReceiver over a HF model of its own, in a
real gloo group with the client's real WeightSender (as tests/weight_sync/test_receive.py)."""

import asyncio
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.errors import error_kind
from rollout.client.sidecar_link import ACTIVE, DROPPED, JOINING, SidecarError, SidecarGoneError
from rollout.client.weight_sync_client import WeightSyncClient
from tests.weight_sync.test_receive import Worker
from weight_sync import weights_checksum
from weight_sync.engine_side.params_target import ParamsTarget
from weight_sync.engine_side.receive import PushReceiver
from weight_sync.engine_side.staging_memory import StagingPool

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 20.0


async def _fails_after_the_bytes(links, i, answer):
    """A member whose engines took every byte, then failed to commit."""
    await answer()
    raise SidecarError("push_weights failed: an engine died while it committed", "failed")


class FakeLinks:
    """PushLinks over sidecars that are one in-process PushReceiver each, answering as a sidecar
    would (its errors as SidecarError with the sidecar's kind). `faults[(i, tag)]`: the next such
    call of sidecar i runs `fault(links, i, answer)` instead, `answer()` being what it would do."""

    def __init__(self, model_dir, n: int):
        self.receivers = []
        for _ in range(n):
            worker = Worker(model_dir)
            pool = StagingPool(worker.device, keep=True)
            self.receivers.append(PushReceiver(ParamsTarget(worker, pool), pool, worker.device))
        self._states = [ACTIVE] * n
        self.reasons = [""] * n
        self.owner = [None] * n  # a health's weight_sync_owner
        self.faults: dict[tuple[int, str], list] = {}
        self.calls: list[tuple[int, str]] = []

    # -- PushLinks --------------------------------------------------------------------------------
    def members(self, *states):
        return [i for i, s in enumerate(self._states) if s in states]

    def url(self, i):
        return f"tcp://127.0.0.1:{5000 + i}"

    def state(self, i):
        return self._states[i]

    async def call(self, i, call_type, what, timeout=None, **fields):
        if self._states[i] == DROPPED:
            raise SidecarGoneError(self.url(i), self.reasons[i])
        tag = call_type.__struct_config__.tag
        self.calls.append((i, tag))
        faults = self.faults.get((i, tag))
        answer = lambda: self._answer(i, tag, fields)  # noqa: E731
        return await (faults.pop(0)(self, i, answer) if faults else answer())

    async def ask_all(self, call_type, what, timeout, states, **fields):
        out = []
        for i in self.members(*states):
            try:
                out.append((i, await self.call(i, call_type, what, timeout, **fields)))
            except SidecarGoneError:
                pass
        return out

    def drop(self, i, reason):
        self._states[i], self.reasons[i] = DROPPED, reason

    def pushed(self, members, version):
        missed = [i for i in self.members(ACTIVE) if i not in members]
        for i in members:
            self._states[i] = ACTIVE
        for i in missed:
            self._states[i] = JOINING
        return missed

    def gone_reasons(self):
        return "; ".join(f"{self.url(i)}: {self.reasons[i]}" for i in self.members(DROPPED))

    # -- a sidecar's answers ----------------------------------------------------------------------
    async def _answer(self, i, tag, fields):
        r = self.receivers[i]
        try:
            if tag == "health":
                return {"ok": True, "workers": 1, "dtype": "float32", "pushing": False,
                        "engine_states": [{"state": "live"}], "weight_sync_owner": self.owner[i]}
            if tag == "init_weight_sync":
                return await asyncio.to_thread(r.join, fields["host"], fields["port"], fields["world_size"],
                                               fields["rank_offset"], fields["secret"], fields["timeout_s"],
                                               fields["group_name"])
            if tag == "push_weights":
                return await asyncio.to_thread(r.receive, fields["manifest"], fields["group_name"])
            if tag == "close_weight_sync":
                return r.group is not None and r.close_group(r.group)
        except Exception as e:
            raise SidecarError(f"{tag} failed on {self.url(i)}: {e}", error_kind(e)) from e
        raise AssertionError(f"unexpected call {tag}")

    def checksum(self, i):
        return weights_checksum(self.receivers[i].target.served())

    def tagged(self, tag):
        return [i for i, t in self.calls if t == tag]


@pytest.fixture
def trainer(qwen2_dir):
    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()


def _step(model, seed):
    """An optimizer step's shape: a few elements move."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01 * (torch.rand(p.shape, generator=g) < 0.03))


async def _closing(client, body):
    try:
        return await body
    finally:
        await client.close()


def test_a_sidecar_another_live_trainer_owns_refuses_before_any_group_forms(qwen2_dir):
    links = FakeLinks(qwen2_dir, 2)
    links.owner[1] = {"group_name": "someone-else", "alive": True}
    client = WeightSyncClient(links)

    with pytest.raises(SidecarError, match="refused by tcp://127.0.0.1:5001") as e:
        asyncio.run(_closing(client, client.init_weight_sync(timeout_s=TIMEOUT_S)))
    assert e.value.kind == "refused"
    assert links.tagged("init_weight_sync") == []  # nobody was asked to join


def test_a_push_every_sidecar_refuses_is_not_tried_again_and_keeps_the_group(qwen2_dir, trainer):
    links = FakeLinks(qwen2_dir, 2)
    _step(trainer, 1)

    async def refuse(links, i, answer):
        raise SidecarError("push_weights failed: version 1 does not go up", "refused")

    async def body(client):
        await client.init_weight_sync(timeout_s=TIMEOUT_S)
        group = client.sender.group
        links.faults = {(0, "push_weights"): [refuse], (1, "push_weights"): [refuse]}
        with pytest.raises(SidecarError, match="does not go up") as e:
            await client.push_weights(trainer, 1)
        assert e.value.kind == "refused"
        assert client.sender.group is group and group.ready  # nothing moved: the same group pushes next
        assert client.pushed is None
        out = await client.push_weights(trainer, 2)
        assert [links.checksum(i) for i in range(2)] == [client.checksum_of(trainer)] * 2
        return out

    client = WeightSyncClient(links)
    out = asyncio.run(_closing(client, body(client)))
    assert links.tagged("push_weights") == [0, 1, 0, 1] and links.tagged("init_weight_sync") == [0, 1]
    assert out["version"] == 2 and len(out["sidecars"]) == 2


def test_a_torn_push_fails_and_is_not_pushed_again(qwen2_dir, trainer):
    """A member that fails after the bytes (its commit failed): the push raises with its reason,
    records nothing, and is not sent again (the members that committed would refuse it)."""
    links = FakeLinks(qwen2_dir, 2)

    async def body(client):
        await client.init_weight_sync(timeout_s=TIMEOUT_S)
        links.faults = {(1, "push_weights"): [_fails_after_the_bytes]}
        with pytest.raises(SidecarError, match="died while it committed") as e:
            await client.push_weights(trainer, 1)
        return e.value

    client = WeightSyncClient(links)
    err = asyncio.run(_closing(client, body(client)))
    assert err.kind == ""
    assert links.tagged("push_weights") == [0, 1]  # one try
    assert client.pushed is None and links.members(ACTIVE) == [0, 1]


def test_a_push_that_returned_early_and_then_tore_raises_from_its_handle(qwen2_dir, trainer):
    """wait=False: the call returns once the bytes are out; a member failing after that is not
    pushed to again (the bytes are gone), and the handle raises its reason."""
    links = FakeLinks(qwen2_dir, 2)

    async def body(client):
        await client.init_weight_sync(timeout_s=TIMEOUT_S)
        links.faults = {(1, "push_weights"): [_fails_after_the_bytes]}
        handle = await client.push_weights(trainer, 1, wait=False)
        with pytest.raises(SidecarError, match="died while it committed"):
            await handle
        return await client.push_weights(trainer, 2)

    client = WeightSyncClient(links)
    out = asyncio.run(_closing(client, body(client)))
    assert links.tagged("push_weights") == [0, 1, 0, 1] and out["version"] == 2 and client.pushed == 2


@pytest.mark.parametrize("when", ["before the bytes", "after the commit vote"])
def test_a_member_that_goes_is_left_out(qwen2_dir, trainer, when, caplog):
    """One that goes before the bytes: the push goes again without it, in a new group. One that
    goes after the commit vote: the others hold the push, which is not sent again."""
    links = FakeLinks(qwen2_dir, 2)

    async def goes(links, i, answer):
        if when == "after the commit vote":
            await answer()
        links.drop(i, "its connection closed")
        raise SidecarGoneError(links.url(i), "its connection closed")

    async def body(client):
        await client.init_weight_sync(timeout_s=TIMEOUT_S)
        links.faults = {(1, "push_weights"): [goes]}
        out = await client.push_weights(trainer, 1)
        assert links.checksum(0) == client.checksum_of(trainer)
        return out

    client = WeightSyncClient(links)
    _step(trainer, 1)
    with caplog.at_level(logging.WARNING, logger="rollout.client"):
        out = asyncio.run(_closing(client, body(client)))
    assert len(out["sidecars"]) == 1 and client.pushed == 1
    if when == "before the bytes":
        assert links.tagged("push_weights") == [0, 1, 0] and links.tagged("init_weight_sync") == [0, 1, 0]
        assert client.members == (0,)
    else:
        assert links.tagged("push_weights") == [0, 1]
        assert "committed on every sidecar left" in caplog.text


def test_sidecars_whose_engines_changed_regroup_and_push_again(qwen2_dir, trainer):
    """Every member refuses the push for a new group (an engine of each was restarted since it
    formed): nothing moved, a new group forms and the push goes again."""
    links = FakeLinks(qwen2_dir, 2)

    async def regroup(links, i, answer):
        raise SidecarError("push_weights failed: an engine was restarted since the group formed", "regroup")

    async def body(client):
        await client.init_weight_sync(timeout_s=TIMEOUT_S)
        first = client.sender.group
        links.faults = {(0, "push_weights"): [regroup], (1, "push_weights"): [regroup]}
        out = await client.push_weights(trainer, 1)
        assert client.sender.group is not first
        assert [links.checksum(i) for i in range(2)] == [client.checksum_of(trainer)] * 2
        return out

    client = WeightSyncClient(links)
    _step(trainer, 1)
    out = asyncio.run(_closing(client, body(client)))
    assert links.tagged("init_weight_sync") == [0, 1, 0, 1] and links.tagged("push_weights") == [0, 1, 0, 1]
    assert len(out["sidecars"]) == 2


def test_deltas_go_after_a_full_push_and_a_full_one_after_a_group_change_and_every_n(qwen2_dir, trainer):
    links = FakeLinks(qwen2_dir, 2)

    async def body(client):
        await client.init_weight_sync(timeout_s=TIMEOUT_S)
        client.anchors.every = 3
        sent = []
        for version in range(1, 8):
            if version == 3:
                links.drop(1, "removed")  # the group changes: the next push is full
            _step(trainer, version)
            out = await client.push_weights(trainer, version, delta=True)
            assert links.checksum(0) == client.checksum_of(trainer)
            sent.append(out["delta"])
        return sent

    client = WeightSyncClient(links)
    sent = asyncio.run(_closing(client, body(client)))
    # full (a new group), a delta, full (a new group: one went), 2 deltas, full (every 3rd), a delta
    assert sent == [False, True, False, True, True, False, True]
