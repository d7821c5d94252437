"""The sidecar's staged-push coordinator on its own (rollout/sidecar/push_coordinator.py), with no front end:
a real engine behind a RolloutManager, the trainer's WeightSender in this process, gloo on loopback."""

import asyncio
import copy
import socket

import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.errors import EngineUnhealthyError
from rollout.sidecar.manager import RolloutManager
from rollout.sidecar.push_coordinator import (
    OwnedElsewhere, Owner, PushCoordinator, TrainerLost, WeightSyncRefused, trainer_lost,
)
from tests.engine.helpers import hf_greedy
from weight_sync import EXTENSION, WeightSender, WeightSyncError, weights_checksum
from weight_sync.common.progress import FAILED_MARK, SENT_MARK
from weight_sync.engine_side.engines import engines_checksums, join_engines
from weight_sync.trainer.push import run_push

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 20.0
PROMPT = [9, 10, 11]


@pytest.fixture(scope="module")
def manager(qwen2_dir, loop):
    cfg = EngineConfig(model=qwen2_dir, max_num_seqs=8, max_model_len=256, kv_cache_memory_gb=0.1,
                       worker_extension_cls=EXTENSION)
    m = RolloutManager([AsyncEngine(cfg)])
    yield m
    loop.run_until_complete(m.supervisor.close())
    m.engines[0].shutdown()


@pytest.fixture
def pushes(manager):
    return PushCoordinator(manager, manager.state, stall_s=5.0)


class Group:
    """A trainer's group as a front end joins and leaves it; what was left is recorded."""

    def __init__(self, sender: WeightSender | None = None, host="127.0.0.1", port=None, name="g"):
        self.sender, self.left = sender, []
        self.info = sender.open_group(world_size=2, timeout_s=TIMEOUT_S) if sender else None
        if sender:
            host, port, name = self.info["host"], self.info["port"], self.info["group_name"]
        self.owner = Owner(name, host, port, self.leave, store=self.info)

    async def leave(self, engines, mid_push: bool) -> None:
        self.left.append(mid_push)
        await asyncio.gather(*(e.collective_rpc("close_weight_sync", timeout=5, args=(not mid_push,))
                               for e in engines), return_exceptions=True)

    async def join(self, engines) -> None:
        if self.sender is not None:
            await asyncio.gather(asyncio.to_thread(self.sender.join_group), join_engines(engines, self.info, 1))


def _listening():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


async def _greedy(manager) -> list[int]:
    [r] = await manager.generate_group(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return r.token_ids


def test_one_trainer_owns_the_weight_sync_until_it_is_gone_or_taken_over(pushes, loop):
    first_port, second_port = _listening(), _listening()
    first = Group(port=first_port.getsockname()[1], name="first")
    second = Group(port=second_port.getsockname()[1], name="second")
    loop.run_until_complete(pushes.take(first.owner, first.join))
    with pytest.raises(OwnedElsewhere, match="another trainer owns") as refused:
        loop.run_until_complete(pushes.take(second.owner, second.join))
    assert refused.value.owner is first.owner and pushes.owner is first.owner and first.left == []
    assert loop.run_until_complete(pushes.owner_status()) == {"group_name": "first", "alive": True}

    loop.run_until_complete(pushes.take(second.owner, second.join, take_over=True))
    assert pushes.owner is second.owner and first.left == [False]  # the replaced group is left
    with pytest.raises(WeightSyncRefused, match="another trainer took over"):
        pushes.engines_for(1, "first")
    second_port.close()  # the second trainer is gone: the first takes it back without take_over
    loop.run_until_complete(pushes.take(first.owner, first.join))
    assert pushes.owner is first.owner and second.left == [False]
    pushes.release(second.owner)  # not the owner: nothing changes
    assert pushes.owner is first.owner
    pushes.release(first.owner)
    assert pushes.owner is None and loop.run_until_complete(pushes.owner_status()) is None
    first_port.close()


def test_a_push_stages_while_the_engines_serve_then_swaps_commits_and_counts(manager, pushes, qwen2_dir,
                                                                             hf_models, loop):
    trainer = copy.deepcopy(hf_models["qwen2"])
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    sender = WeightSender(bucket_bytes=1 << 20, timeout_s=TIMEOUT_S)
    group = Group(sender)
    try:
        engines = loop.run_until_complete(pushes.take(group.owner, group.join))
        before, counters, version = loop.run_until_complete(_greedy(manager)), manager.counters, pushes.version + 1

        def deliver(manifest):
            return [("sidecar", asyncio.ensure_future(
                pushes.stage(pushes.engines_for(version, group.owner.group_name), manifest, TIMEOUT_S,
                             group.owner.group_name)))]

        outcome = loop.run_until_complete(run_push(sender, trainer, version, deliver, TIMEOUT_S))
        [staged] = outcome.results
        assert staged.engines == engines and staged.results == ["staged"]
        assert loop.run_until_complete(_greedy(manager)) == before  # staged: the old weights serve on
        assert manager.counters["pause_seconds"] == counters["pause_seconds"]  # and the engines never paused
        out = loop.run_until_complete(pushes.finish(staged, version, "keep"))
        assert out["version"] == version and out["transfer_seconds"] > 0 and out["swap_seconds"] >= 0
        assert loop.run_until_complete(engines_checksums(engines)) == [weights_checksum(trainer.named_parameters())]
        assert loop.run_until_complete(_greedy(manager)) == hf_greedy(trainer, PROMPT, 8, True)
        after = manager.counters
        assert pushes.version == version and after["pushes"] == counters["pushes"] + 1
        assert after["failed_pushes"] == counters["failed_pushes"]
        with pytest.raises(WeightSyncRefused, match="does not go up"):
            pushes.engines_for(version, group.owner.group_name)
    finally:
        sender.close_group()


def test_a_push_its_trainer_gives_up_while_it_stages_is_given_up_on_every_engine(manager, pushes, hf_models, loop):
    """The trainer marks the push failed in its store (its broadcast failed: WeightSyncGroup.mark_progress)
    while the workers wait in its vote: the watch sees it, not the group's timeout, and nothing changes."""
    sender = WeightSender(bucket_bytes=1 << 20, timeout_s=TIMEOUT_S)
    group = Group(sender)
    try:
        engines = loop.run_until_complete(pushes.take(group.owner, group.join))
        served, failed = loop.run_until_complete(engines_checksums(engines)), manager.counters["failed_pushes"]
        manifest = sender.prepare(copy.deepcopy(hf_models["qwen2"]), pushes.version + 1).manifest

        async def trainer_gives_up():
            await asyncio.sleep(1.0)
            sender.group.mark_progress(manifest.push_id, FAILED_MARK)

        async def push():
            await asyncio.gather(pushes.stage(engines, manifest, TIMEOUT_S, group.owner.group_name),
                                 trainer_gives_up())

        started = loop.time()
        with pytest.raises(TrainerLost, match="gave the push up mid-push"):
            loop.run_until_complete(push())
        assert loop.time() - started < TIMEOUT_S / 2
        assert group.left == [True] and manager.counters["failed_pushes"] == failed + 1
        assert loop.run_until_complete(engines_checksums(engines)) == served and not manager.state.pushing
    finally:
        sender.close_group()


def test_a_trainer_is_watched_until_it_marks_its_part_sent(loop):
    """A mark that stands still is a stalled trainer; once it marked every byte sent and the commit
    vote passed (SENT_MARK), what is left is the engines' own work (their derived copies), and the
    push is not given up whatever the trainer does next: here it closes its store and goes."""
    sender = WeightSender(timeout_s=TIMEOUT_S)
    group = Group(sender)
    try:
        sender.group.mark_progress("stuck", 5)
        t0 = loop.time()
        why = loop.run_until_complete(trainer_lost(group.owner, "stuck", stall_s=0.5, period_s=0.1))
        assert "made no progress" in why and loop.time() - t0 < 5
        sender.group.mark_progress("sent", 5)
        sender.group.mark_progress("sent", SENT_MARK)
        watch = asyncio.ensure_future(trainer_lost(group.owner, "sent", stall_s=0.5, period_s=0.1), loop=loop)
        loop.run_until_complete(asyncio.sleep(1.0))
        sender.close_group()  # the trainer goes: its port refuses, its store is silent
        loop.run_until_complete(asyncio.wait({watch}, timeout=3.0))
        assert not watch.done()
        watch.cancel()
    finally:
        sender.close_group()


def test_an_engine_left_with_torn_weights_is_stopped_by_its_supervisor(manager, pushes, hf_models, loop):
    """Last in this module: its engine stays down (this manager has no engine factory)."""
    group = Group(port=None, host=None, name="torn")  # no port to watch
    engines = loop.run_until_complete(pushes.take(group.owner, group.join))
    manifest = WeightSender().prepare(hf_models["qwen2"], pushes.version + 1).manifest
    failed = manager.counters["failed_pushes"]

    async def receive():
        return [EngineUnhealthyError(["a commit failed half way"])]

    with pytest.raises(WeightSyncError, match="half way"):
        loop.run_until_complete(pushes.push_paused(engines, manifest, "keep", receive))
    assert engines[0].proc.wait(10) is not None  # stopped, for the supervisor to restart
    assert manager.counters["failed_pushes"] == failed + 1
