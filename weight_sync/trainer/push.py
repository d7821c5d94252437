"""The trainer's side of a push, written once. Callers differ only in how the manifest reaches
the workers (`deliver`): `weight_sync.trainer.local_engines` calls its local engines' `receive_weights`,
`rollout.client` sends `push_weights` to each sidecar, which pauses its engines and calls theirs.

1. prepare: the manifest, on the previous push's layout when there is one and it was not refused
   (no walk yet; a refused layout is never started on again);
2. deliver: the manifest goes out; each receiver's outcome is awaited later;
3. walk: the trainer lists its weights and checks them against the layout while the workers
   check the manifest against their models;
4. gate: the trainer votes only once every worker marked itself ready in the group's store
   (`WeightSyncGroup.mark_ready`), so it never waits in a collective some rank will not join;
   a receiver that fails before that calls the push off (nothing moved; the group is closed,
   which frees the workers already voting);
5. send: the votes and buckets (`WeightSender.send`, on a thread: it blocks);
6. a layout that no longer fits is refused by every rank before a byte moves
   (StaleManifestError; the trainer marks the push withdrawn first, so a sidecar counts no failed
   push for it): once more from 1, walking the weights afresh; a LoRA adapter push that
   a worker refuses for lacking its base (NeedsBaseError): once more with the base.

A trainer of several ranks pushes from rank 0; the others call `trainer_ranks.follow_push`
meanwhile and take part in rank 0's gathers until it tells them DONE (at the end of run_push).

What the receivers do with the outcome (commit version tags, error replies) is the caller's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine.errors import error_kind
from weight_sync.common.manifest import Manifest
from weight_sync.common.votes import (
    DeltaBaseError, NeedsBaseError, StaleManifestError, WeightSyncError, WeightSyncRefusedError, describe,
)
from weight_sync.trainer.lora_push import push_source
from weight_sync.trainer.ranks import PeersFollowing
from weight_sync.trainer.sender import PreparedPush, WeightSender

log = logging.getLogger(__name__)

GIVE_UP_GRACE_S = 2.0  # a receiver failed mid-transfer: how long the workers have to end it themselves

# deliver(manifest) -> one (name, outcome) per receiver; the outcome is the receiver's result or raises its error
Deliver = Callable[[Manifest], list[tuple[str, Awaitable]]]


@dataclass
class PushOutcome:
    trainer: dict | BaseException  # WeightSender.send's result, or its error
    names: list[str]  # the receivers, in delivery order
    results: list  # one per receiver: its result, or its error

    @property
    def refused(self) -> bool:
        """Every receiver refused the push before touching its engines: nothing changed anywhere."""
        return bool(self.results) and all(isinstance(r, BaseException) and _is_refusal(r) for r in self.results)

    @property
    def regroup(self) -> bool:
        """Refused, and some receiver asked for a new group (its engines changed since this one formed)."""
        return self.refused and any(error_kind(r) == "regroup" for r in self.results)

    @property
    def errors(self) -> list[str]:
        """Every failure, the trainer's first, each as "who: why"."""
        out = [f"{n}: {describe(r)}" for n, r in zip(self.names, self.results) if isinstance(r, BaseException)]
        if isinstance(self.trainer, BaseException):
            out.insert(0, f"trainer: {describe(self.trainer)}")
        return out


async def run_push(sender: WeightSender, weights, version: int, deliver: Deliver, timeout_s: float | None = None,
                   progress=None, on_sent: Callable[[dict], None] | None = None, mode: str = "adapter",
                   peers: PeersFollowing | None = None, delta: bool | None = False, anchor: bool = False
                   ) -> PushOutcome:
    """One push, steps 1-6 of the module doc. `timeout_s` bounds the wait for the workers'
    readiness (default: the group's timeout); every network step is bounded by the group's.
    `on_sent(trainer_result)` is called once the trainer's send succeeded, before the receivers'
    outcomes are in: every worker holds every byte (the commit vote passed), and the trainer's
    weights are its own again (push_weights(wait=False) returns there).
    `mode`: how a PEFT model goes, "adapter" (its LoRA factors; the base too, once, to a worker
    that lacks it) or "merged" (weight_sync.trainer.lora_push). `peers`: a caller that pushes again on failure
    passes its own PeersFollowing and finishes it when done (by default this call finishes its own).
    `delta` (weight_sync/common/delta_push.py): None sends only what changed when the sender keeps the last
    push's weights and that is fewer bytes (it keeps them when they travel in 2-byte floats); True
    whenever it keeps them (and keeps them); False (the default) the full weights, keeping no copy. `anchor`: the full weights this time, kept as the next delta's base. A delta
    that some worker has no base for is refused before any byte (DeltaBaseError): once more, in full."""
    own = peers is None
    peers = peers or PeersFollowing()

    def sent(result: dict) -> None:
        peers.finish()  # nothing more to gather: the trainer's other ranks go on with it
        on_sent(result)

    try:
        if sender.group is None or not sender.group.ready:
            raise WeightSyncRefusedError("no weight-sync group: init_weight_sync first")
        weights = push_source(weights, mode)
        _keep_for_deltas(sender, delta)
        prepared = None if anchor or delta is False else _delta(sender, weights, version, delta)
        prepared = prepared or sender.prepare(weights, version, reuse_layout=True)
        outcome = await _attempt(sender, prepared, deliver, timeout_s, progress, on_sent and sent)
        if isinstance(outcome.trainer, DeltaBaseError):
            log.info("a worker does not hold the delta's base: pushing version %d in full", version)
            prepared = sender.prepare(prepared.weights, version, reuse_layout=True)
            outcome = await _attempt(sender, prepared, deliver, timeout_s, progress, on_sent and sent)
        if isinstance(outcome.trainer, StaleManifestError):
            prepared = sender.prepare(prepared.weights, version)
            outcome = await _attempt(sender, prepared, deliver, timeout_s, progress, on_sent and sent)
        if isinstance(outcome.trainer, NeedsBaseError):
            log.info("a worker lacks the adapter's base: pushing version %d with the base", version)
            prepared = sender.prepare(dataclasses.replace(weights, with_base=True), version)
            outcome = await _attempt(sender, prepared, deliver, timeout_s, progress, on_sent and sent)
        return outcome
    finally:
        if own:
            peers.finish()  # a trainer's other ranks (trainer_ranks.follow_push) stop following


def _keep_for_deltas(sender: WeightSender, delta: bool | None) -> None:
    """Whether the sender keeps what it sends as the next delta's base (see run_push's `delta`)."""
    if delta is False:
        sender.keep_sent, sender.kept = False, None
    elif delta:
        sender.keep_sent = True
    elif sender.keep_sent is False:
        sender.keep_sent = None  # auto: kept when the push travels in 2-byte floats


def _delta(sender: WeightSender, weights, version: int, delta: bool | None) -> PreparedPush | None:
    """The delta push to make, if any: forced, or (auto) when it is fewer bytes than the full push."""
    prepared = sender.prepare_delta(weights, version)
    if prepared is not None and delta is None and prepared.manifest.total_bytes >= prepared.delta.full_bytes:
        return None
    return prepared


async def _attempt(sender: WeightSender, prepared: PreparedPush, deliver: Deliver, timeout_s: float | None,
                   progress, on_sent) -> PushOutcome:
    delivered = deliver(prepared.manifest)
    names = [name for name, _ in delivered]
    receivers = [asyncio.ensure_future(outcome) for _, outcome in delivered]
    await asyncio.sleep(0)  # the manifest leaves now, and the trainer lists its weights meanwhile (on
    sender.walk(prepared)   # this thread: a thread of its own would hold the GIL the replies need)
    gate = _Gate(sender, prepared, names, receivers, timeout_s)
    try:
        trainer = (await asyncio.gather(asyncio.to_thread(sender.send, prepared, progress, gate.wait),
                                        return_exceptions=True))[0]
        gate.sent = True
    except asyncio.CancelledError:  # the trainer's thread is told to stop at the gate; workers freed
        gate.call_off("the push was cancelled")
        sender.close_group()
        for r in receivers:
            r.cancel()
        raise
    # Workers that marked themselves ready wait in the vote: closing the group frees them. When every
    # receiver refused the push up front (before any worker was touched) nobody waits: the group
    # stays, and the trainer pushes again without a new init_weight_sync.
    if not gate.opened and not all(r.done() and _refused(r) for r in receivers):
        sender.close_group()
    if on_sent is not None and not isinstance(trainer, BaseException):
        on_sent(trainer)
    return PushOutcome(trainer, names, list(await asyncio.gather(*receivers, return_exceptions=True)))


def _is_refusal(e: BaseException) -> bool:
    """Refused before any engine was touched (the receiver's own error, or a sidecar's reply kind)."""
    return error_kind(e) in ("refused", "regroup")


def _refused(task: asyncio.Future) -> bool:
    e = None if task.cancelled() else task.exception()
    return e is not None and _is_refusal(e)


class _Gate:
    """Step 4: opens once every worker is ready for this push, or is called off by the first
    receiver that fails before that (it would never vote)."""

    def __init__(self, sender: WeightSender, prepared: PreparedPush, names: list[str], receivers: list,
                 timeout_s: float | None):
        self.group, self.push_id, self.version = sender.group, prepared.manifest.push_id, prepared.manifest.version
        self.timeout_s = timeout_s or self.group.timeout_s
        self.opened = False
        self.sent = False  # the trainer's send returned
        self.reason: str | None = None
        for name, r in zip(names, receivers):
            r.add_done_callback(lambda task, name=name: self._on_done(name, task))

    def _on_done(self, name: str, task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is None:
            return
        if not self.opened:
            self.call_off(f"{name}: {describe(task.exception())}")
        elif not self.sent and self.group.chain is not None:
            # a receiver lost while the bytes flow: when its host's link is down, no worker of it can
            # say so, and the rank before it waits in a send it never reads. Unless the workers end the
            # transfer themselves (a killed host's neighbours do, at once), it is marked as a worker
            # giving up, which stops the trainer's send (BucketSender._watch_workers). Not at once: a
            # cut while the first worker still reads leaves the trainer's send in flight hung.
            asyncio.get_running_loop().call_later(GIVE_UP_GRACE_S, self._give_up, name)

    def _give_up(self, name: str) -> None:
        if self.sent:
            return
        log.warning("%s failed %.0f s ago and push %s still sends: giving it up", name, GIVE_UP_GRACE_S, self.push_id)
        try:
            self.group.mark_worker_failed(self.push_id)
        except Exception as e:  # noqa: BLE001 - the push then ends at the workers' stall watch
            log.warning("could not mark push %s given up: %s", self.push_id, e)
        # past its last bucket the trainer waits in the commit vote, where no watch runs and the lost
        # host never votes: its own links end that wait (and a send still in flight, as the watch would)
        self.group.cut_links()

    def call_off(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        try:
            self.group.call_off(self.push_id)
        except Exception as e:  # the trainer then times out of the gate
            log.warning("could not call push %s off: %s", self.push_id, e)

    def wait(self) -> None:
        """On the trainer's thread, right before its vote."""
        if not self.group.wait_ready(self.push_id, self.timeout_s):
            raise WeightSyncError(f"push of version {self.version} called off before any byte moved: "
                                  f"{self.reason}; the trainer's group is closed, init_weight_sync again")
        self.opened = True
