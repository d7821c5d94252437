"""How a push's buckets reach the workers when they sit on several hosts: passed down a chain.

gloo's broadcast is a binomial tree of whole messages: with the trainer and 3 workers the
trainer sends every byte twice (to rank 1, then to rank 2 while rank 1 sends to rank 3), and
nothing is forwarded before it has arrived whole. Over links of one speed that is ~2x one host's
time for 3 hosts. A chain sends each byte over each link once: the trainer sends a bucket in
chunks to the first worker, which passes each chunk on to the next as soon as it has it, and so
on, so a push takes one link's time plus a chunk's per extra host (the pipelined ring NCCL's
broadcast already is; on NCCL nothing changes).

Used when the group is gloo, has 2+ workers and some worker is on another host than the trainer
(each rank publishes the address it reaches the trainer from); otherwise the plain broadcast.
The trainer may choose for its group with WEIGHT_SYNC_FAN_OUT=chain|broadcast (default auto);
its workers follow the choice it wrote in the group's metadata.
The chain visits the trainer's own host first, then each host's ranks one after another, so
each link is crossed once. Only the bytes move this way: the votes before and after are the
group's collectives, as before, so a push is still all or nothing.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import threading
from concurrent.futures import Future, InvalidStateError

import torch

from weight_sync.common.hosts import advertised_address

MODES = ("auto", "chain", "broadcast")
log = logging.getLogger(__name__)
TAG = 7  # the chain's point-to-point messages; nothing else in a weight-sync group uses tags
MIN_CHUNK, MAX_CHUNK = 256 * 1024, 4 * 1024 * 1024


def fan_out_mode() -> str:
    """The trainer's choice (WEIGHT_SYNC_FAN_OUT), checked."""
    mode = os.environ.get("WEIGHT_SYNC_FAN_OUT", "auto")
    if mode not in MODES:
        raise ValueError(f"WEIGHT_SYNC_FAN_OUT must be one of {MODES}, got {mode!r}")
    return mode


def chain_order(addresses: dict[int, str], mode: str = "auto") -> list[int] | None:
    """The ranks in chain order (the trainer, rank 0, first; its host's workers next; then each
    other host's ranks together), or None for the plain broadcast: asked for, or as good (one
    worker, or every worker on the trainer's host) unless the chain is asked for."""
    workers = [r for r in addresses if r != 0]
    home = addresses[0]
    if mode == "broadcast" or (mode == "auto" and (len(workers) < 2 or all(addresses[r] == home for r in workers))):
        return None
    return [0, *sorted(workers, key=lambda r: (addresses[r] != home, addresses[r], r))]


def chunk_bytes(nbytes: int) -> int:
    """Small enough that the chain fills fast (a chunk's time per extra host), large enough that
    a chunk's fixed cost does not show: a sixteenth of the bucket, within 256 KiB..4 MiB."""
    return min(MAX_CHUNK, max(MIN_CHUNK, nbytes // 16))


def plan_chain(prefix_store, rank: int, world_size: int, host: str, timeout_s: float,
               mode: str = "auto") -> list[int] | None:
    """Every rank publishes its address in the group's store and reads everyone's (at forming)."""
    if mode == "broadcast":
        return None
    prefix_store.set(f"addr/{rank}", json.dumps(advertised_address(host)))
    keys = [f"addr/{r}" for r in range(world_size)]
    prefix_store.wait(keys, datetime.timedelta(seconds=timeout_s))
    return chain_order({r: json.loads(prefix_store.get(k)) for r, k in enumerate(keys)}, mode)


class RelayWork:
    """A bucket's relay, waited like a collective's Work."""

    def __init__(self):
        self.future: Future = Future()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.future.result(None if timeout is None else timeout.total_seconds())
        return True


def _settle(work: RelayWork, error: BaseException | None = None) -> None:
    """A bucket's outcome, once: a cut may have failed it already."""
    try:
        if error is None:
            work.future.set_result(None)
        else:
            work.future.set_exception(error)
    except InvalidStateError:
        pass


def cut_pair(pg, peer: int) -> None:
    """Close this rank's link to `peer` now, from any thread: a send `peer` never receives (gloo
    sends once the receiver asked), whose wait times out at once, and gloo then closes the pair,
    failing every op pending on it on both sides."""
    try:
        pg.send([torch.zeros(1, dtype=torch.uint8)], peer, TAG + 1).wait(datetime.timedelta(milliseconds=1))
    except Exception:  # noqa: BLE001 - the closure is the point
        pass


class ChainRelay:
    """This rank's link of the chain: receives each bucket's chunks from the rank before it and
    passes them to the rank after it, on a thread of its own so that forwarding never waits for
    the caller; buckets are relayed in the order they are submitted."""

    def __init__(self, pg, order: list[int], rank: int, timeout_s: float | None = None):
        i = order.index(rank)
        self.pg = pg
        # each wait's own bound (the group's): the backend's default is only its rendezvous's
        self._timeout = () if timeout_s is None else (datetime.timedelta(seconds=float(timeout_s)),)
        self.prev = order[i - 1] if i > 0 else None
        self.next = order[i + 1] if i + 1 < len(order) else None
        self._queue: queue.Queue = queue.Queue()
        self._failed: BaseException | None = None
        self._current: RelayWork | None = None  # the bucket being relayed
        self._thread = threading.Thread(target=self._run, daemon=True, name="weight-sync-relay")
        self._thread.start()

    def submit(self, tensor: torch.Tensor) -> RelayWork:
        work = RelayWork()
        self._queue.put((tensor.reshape(-1).view(torch.uint8), work))
        return work

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            data, work = item
            if self._failed is not None:  # a broken chain: later buckets cannot arrive either
                _settle(work, self._failed)
                continue
            self._current = work
            try:
                self._relay(data)
                _settle(work)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                self._failed = self._failed or e
                log.warning("relay of a bucket failed on this rank (%s): closing the link to the rank before it", e)
                self._close_upstream()
                _settle(work, e)
            self._current = None

    def _relay(self, data: torch.Tensor) -> None:
        """One bucket: its chunks received (from `prev`) and passed on (to `next`)."""
        step = chunk_bytes(data.numel())
        chunks = [data[i:i + step] for i in range(0, data.numel(), step)]
        recvs = [self.pg.recv([c], self.prev, TAG) for c in chunks] if self.prev is not None else None
        sends = []
        for k, c in enumerate(chunks):
            if recvs is not None:
                recvs[k].wait(*self._timeout)
            if self.next is not None:
                sends.append(self.pg.send([c], self.next, TAG))
        for s in sends:
            s.wait(*self._timeout)

    def _close_upstream(self) -> None:
        """After a failure here (the next rank gone, which breaks every pending op of this rank's
        gloo context): the rank before this one would send its next bucket into a rank that no
        longer reads, until the group's timeout, and so would the trainer behind it. Cutting that
        link passes the failure up the chain at once ("connection closed by peer")."""
        self._cut(self.prev)

    def cut_next(self) -> None:
        """Close the link to the next rank now, and fail the buckets still relaying: their waiter
        learns at once, not at the group's timeout. (Closing the pair wakes a send blocked on a
        rank that stopped reading, but not always one in flight to a rank that still reads: that
        one keeps this thread until the timeout, in a group its owner is closing anyway.)"""
        self._cut(self.next)
        self._failed = self._failed or RuntimeError("the chain was cut: a worker gave the push up")
        current = self._current
        if current is not None:
            _settle(current, self._failed)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:  # closed: the thread still needs it
                self._queue.put(None)
                return
            _settle(item[1], self._failed)

    def _cut(self, peer: int | None) -> None:
        if peer is not None:
            cut_pair(self.pg, peer)

    def close(self) -> None:
        self._queue.put(None)
