"""The push protocol on its own (weight_sync.engine_side.receive.PushReceiver): no engine, no sidecar. The
trainer (a real WeightSender) and the receivers are threads of this process on a real gloo group;
each receiver's target is the parameters of a HF model of its own (ParamsTarget)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.weight_sync.test_group import _run
from weight_sync import WeightSender, WeightSyncError, weights_checksum
from weight_sync.common.votes import PushRefused
from weight_sync.engine_side.params_target import ParamsTarget
from weight_sync.engine_side.receive import PushReceiver
from weight_sync.engine_side.staging_memory import StagingPool

pytestmark = pytest.mark.timeout(120)
BUCKET = 1 << 16  # many buckets for a tiny model: a transfer can break between two of them


class Worker:
    """What a target reads of its engine's worker: the model, its device, no LoRA bank."""

    def __init__(self, model_dir):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.device = torch.device("cpu")
        self.lora_bank = None
        self.weights_released = False


class PlanFails(ParamsTarget):
    """A target that plans once every byte is in (as an adapter merge does) and breaks there,
    before its commit vote."""

    def plan_needs_bytes(self, m):
        return True

    def plan(self, m, staging):
        raise RuntimeError("this worker broke while the bytes arrived")


def _receiver(worker, target_cls=ParamsTarget):
    pool = StagingPool(worker.device, keep=True)
    return PushReceiver(target_cls(worker, pool), pool, worker.device)


def _form(sender, receivers, timeout_s=10.0):
    info = sender.open_group(world_size=1 + len(receivers), timeout_s=timeout_s)
    joined = _run([sender.join_group] + [lambda r=r, i=i: r.join(**info, rank=1 + i) for i, r in enumerate(receivers)])
    assert not any(isinstance(j, BaseException) for j in joined), joined


def _push(sender, receivers, weights, version, progress=None, inplace=False):
    """The trainer's side and every receiver's, concurrently: (trainer outcome, receivers' outcomes)."""
    prepared = sender.prepare(weights, version)
    wire = prepared.manifest.to_wire()
    receive = [(r.receive_inplace if inplace else r.receive) for r in receivers]
    out = _run([lambda: sender.send(prepared, progress)] + [lambda f=f: f(wire) for f in receive])
    return out[0], out[1:]


@pytest.fixture
def trainer(qwen2_dir):
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    return model


def test_a_push_commits_on_every_receiver_exactly(qwen2_dir, trainer):
    sender, workers = WeightSender(bucket_bytes=BUCKET, timeout_s=10), [Worker(qwen2_dir), Worker(qwen2_dir)]
    receivers = [_receiver(w) for w in workers]
    _form(sender, receivers)
    try:
        sent, got = _push(sender, receivers, trainer, 1)
        assert not isinstance(sent, BaseException), sent
        assert [g["version"] for g in got] == [1, 1] and [r.version for r in receivers] == [1, 1]
        assert {weights_checksum(r.target.served()) for r in receivers} == {sender.checksum(trainer)}
    finally:
        sender.close_group()


def test_a_refused_manifest_moves_no_byte_and_changes_nothing(qwen2_dir, trainer):
    sender, worker = WeightSender(bucket_bytes=BUCKET, timeout_s=10), Worker(qwen2_dir)
    r = _receiver(worker)
    _form(sender, [r])
    before = weights_checksum(r.target.served())
    try:
        wrong = [(n, t[:-1] if n.endswith("embed_tokens.weight") else t) for n, t in trainer.named_parameters()]
        sent, (got,) = _push(sender, [r], wrong, 1)
        assert isinstance(got, PushRefused) and "shape" in str(got)
        assert isinstance(sent, WeightSyncError) and sent.refused
        assert weights_checksum(r.target.served()) == before and r.version is None
        assert r.group is not None and r.group.ready  # a refusal keeps the group: the next push goes through
        sent, (got,) = _push(sender, [r], trainer, 2)
        assert got["version"] == 2 and weights_checksum(r.target.served()) == sender.checksum(trainer)
    finally:
        sender.close_group()


def test_a_transfer_torn_mid_way_commits_nothing_and_closes_the_group(qwen2_dir, trainer):
    sender, worker = WeightSender(bucket_bytes=BUCKET, timeout_s=10), Worker(qwen2_dir)
    r = _receiver(worker)
    _form(sender, [r], timeout_s=3.0)  # a gloo wait on a gone peer may last the group's timeout
    before = weights_checksum(r.target.served())

    def trainer_dies_at_bucket_3(k, n):
        if k == 3:
            raise RuntimeError("the trainer died")

    sent, (got,) = _push(sender, [r], trainer, 1, progress=trainer_dies_at_bucket_3)
    assert isinstance(sent, WeightSyncError) and not sent.refused
    assert isinstance(got, RuntimeError) and "Nothing was committed" in str(got)
    assert weights_checksum(r.target.served()) == before and r.version is None
    assert r.group is None and r.health_problems() == []  # left: init_weight_sync again


def test_in_place_a_transfer_torn_after_the_first_write_leaves_the_worker_unhealthy(qwen2_dir, trainer):
    sender, worker = WeightSender(bucket_bytes=BUCKET, timeout_s=10), Worker(qwen2_dir)
    r = _receiver(worker)
    _form(sender, [r], timeout_s=3.0)  # a gloo wait on a gone peer may last the group's timeout

    def trainer_dies_at_bucket_3(k, n):
        if k == 3:
            raise RuntimeError("the trainer died")

    sent, (got,) = _push(sender, [r], trainer, 1, progress=trainer_dies_at_bucket_3, inplace=True)
    assert isinstance(sent, WeightSyncError)
    assert isinstance(got, RuntimeError) and "weights torn" in str(got)
    assert r.torn and r.health_problems() and r.version is None


def test_no_receiver_commits_unless_every_one_holds_every_byte(qwen2_dir, trainer):
    """The commit vote: one of two receivers breaks after its bytes arrived, before it votes; the
    other holds every byte too, and still commits nothing."""
    sender, workers = WeightSender(bucket_bytes=BUCKET, timeout_s=10), [Worker(qwen2_dir), Worker(qwen2_dir)]
    whole, broken = _receiver(workers[0]), _receiver(workers[1], PlanFails)
    _form(sender, [whole, broken])
    before = weights_checksum(whole.target.served())
    sent, (got_whole, got_broken) = _push(sender, [whole, broken], trainer, 1)
    assert isinstance(got_broken, RuntimeError) and "broke while the bytes arrived" in str(got_broken)
    assert isinstance(got_whole, RuntimeError) and "Nothing was committed" in str(got_whole)
    assert isinstance(sent, WeightSyncError)
    assert weights_checksum(whole.target.served()) == before and whole.version is None


def test_a_push_settled_staged_finishes_while_its_thread_still_lingers(qwen2_dir, trainer, monkeypatch):
    """The receiving thread answers "staged" and lives on a moment; a finish asked for in that moment
    (the engine's loop got there first, as on a slow machine) commits the push, not "still arriving"."""
    import threading

    from weight_sync.engine_side import overlapped_receive as O

    lingering, settle = threading.Event(), O._settle

    def settle_then_linger(staged):
        settle(staged)
        lingering.wait(10)  # the thread's last moment, held open until the finish is done

    monkeypatch.setattr(O, "_settle", settle_then_linger)
    sender, worker = WeightSender(bucket_bytes=BUCKET, timeout_s=10), Worker(qwen2_dir)
    r = _receiver(worker)
    _form(sender, [r])
    overlapped = O.OverlappedReceive(r)
    try:
        prepared = sender.prepare(trainer, 1)
        arrived = overlapped.begin(prepared.manifest.to_wire())
        sent = sender.send(prepared)
        assert sent["version"] == 1 and arrived.result(10) == "staged"
        assert overlapped.staged.thread.is_alive() and overlapped.state() == "staged"
        assert overlapped.finish()["version"] == 1
        assert weights_checksum(r.target.served()) == sender.checksum(trainer)
    finally:
        lingering.set()
        sender.close_group()
