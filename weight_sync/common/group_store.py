"""A group's store, seen from one rank: its keys in the trainer's `TCPStore` (under the group's
name and secret), the gates every rank passes before a collective that some rank may never join
(weight_sync/common/store_gates.py), and the marks a push leaves for those who cannot ask (a
trainer waiting in a send, a sidecar's watchdog). Small facts in the store, beside the collectives:
`WeightSyncGroup` (weight_sync/common/group.py) is a `GroupStore` with a backend.

Who may read them: every key of a group lives under a prefix holding a per-group secret (128
random bits) that the trainer hands to the workers over the authenticated control plane; whoever
lacks it cannot read the group's metadata, claim a rank or touch a push's marks.
"""

from __future__ import annotations

import datetime
import logging
import socket

from torch._C._distributed_c10d import PrefixStore, TCPStore

from weight_sync.common import store_gates as gates

log = logging.getLogger(__name__)


class GroupError(RuntimeError):
    """The group could not be formed, or a collective on it failed or timed out."""


class GroupStore:
    """One generation of a group's keys. The trainer (rank 0) serves the store (`store`, from
    `create_master_store`); the workers connect to it as clients."""

    def __init__(self, *, host: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float,
                 secret: str, store: TCPStore | None = None):
        self.host, self.world_size, self.rank = host, int(world_size), int(rank)
        self.group_name, self.timeout_s = group_name, float(timeout_s)
        self._secret = secret
        self._store = store
        self._wait_store: TCPStore | None = None
        self.port = int(store.port) if store is not None else int(port)

    def _prefix_store(self, store: TCPStore | None = None) -> PrefixStore:
        return _group_keys(self.group_name, self._secret, store or self._store)

    def _waits(self) -> PrefixStore:
        """This rank's own store connection for blocking waits: a client serves one request at a
        time, and a wait must not hold up the call-off (from another thread) that ends it."""
        if self._wait_store is None:
            self._wait_store = TCPStore(self.host, self.port, None, False, _td(self.timeout_s))
        return self._prefix_store(self._wait_store)

    # -- a push's vote gate: the workers arrive at it, the trainer waits for them all, then opens the
    # vote or calls it off; nobody waits in a collective that some rank will not join.
    def mark_ready(self, push_id: str) -> None:
        """A worker about to vote on push `push_id`: count it in; the last one says go."""
        gates.arrive(self._prefix_store(), gates.push_gate(push_id), self.world_size - 1)

    def call_off(self, push_id: str) -> None:
        """End every rank's wait at push `push_id`'s gate without a vote (a worker will not come)."""
        gates.call_off(self._prefix_store(), gates.push_gate(push_id))

    def call_off_forming(self) -> None:
        """End every rank's wait to form this group (a rank will not come): each join raises GroupError."""
        gates.call_off(self._prefix_store(), gates.FORMING)

    def wait_ready(self, push_id: str, timeout_s: float) -> bool:
        """The trainer: True once every worker marked itself ready for push `push_id` (their vote
        is then open), False if it was called off; raises GroupError after `timeout_s`. Forgets
        the push's count."""
        gate = gates.push_gate(push_id)
        try:
            store = self._waits()
            go = gates.wait_go(store, gate, timeout_s)
            gates.forget(store, gate, "go", "arrived")
            return gates.open_vote(store, gate, go)
        except Exception as e:
            raise GroupError(f"waiting for the workers of push {push_id} on rank {self.rank}: {_short(e)}") from e

    def wait_vote(self, push_id: str) -> bool:
        """A worker that marked itself ready: True once the trainer opened push `push_id`'s vote,
        False if it was called off; raises GroupError after the group's timeout or if the
        trainer's store is gone."""
        try:
            return gates.wait_vote(self._waits(), gates.push_gate(push_id), self.timeout_s)
        except Exception as e:
            raise GroupError(f"waiting for the vote of push {push_id} on rank {self.rank}: {_short(e)}") from e

    def vote_passed(self, push_id: str) -> None:
        """The trainer, past push `push_id`'s vote: every worker read the gate; its last key goes."""
        try:
            gates.forget(self._prefix_store(), gates.push_gate(push_id), "vote")
        except Exception as e:  # noqa: BLE001 - a key left behind costs a few bytes; the push goes on
            log.debug("could not forget the vote key of push %s: %s", push_id, e)

    # -- marks: what a push leaves for those who cannot ask (a trainer in a send, a watchdog) ----
    def mark_worker_failed(self, push_id: str) -> None:
        """A worker gave push `push_id` up mid-transfer: the trainer, which may wait in a send to
        a rank that no longer reads, learns it here (BucketSender's watch)."""
        self._prefix_store().set(f"mark/worker_failed/{push_id}", str(self.rank))

    def worker_failed(self, push_id: str) -> bool:
        return self._prefix_store().check([f"mark/worker_failed/{push_id}"])

    def mark_progress(self, push_id: str, mark: int) -> None:
        """The trainer: push `push_id` moved (a count that grows while its bytes go out,
        weight_sync/trainer/progress_marks.py) or ended (weight_sync/common/progress.py's marks). A
        sidecar's watchdog reads it (PushProgress) to tell a stalled or failed trainer from a slow
        one: its engines wait in the transfer, where nothing else can reach them."""
        self._prefix_store().set(f"mark/progress/{push_id}", str(int(mark)))


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def create_master_store(host: str, port: int, world_size: int, timeout_s: float) -> TCPStore:
    """The trainer's store (rank 0 is the server), listening on `host` only: TCPStore alone
    listens on every interface, so it is handed a socket bound here. `port=0` lets the OS pick;
    read `.port`."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # detach(): the store owns the descriptor from now on and closes it when it goes
    return TCPStore(host, port, int(world_size), True, _td(timeout_s), wait_for_workers=False,
                    master_listen_fd=sock.detach())


def _group_keys(group_name: str, secret: str, store: TCPStore) -> PrefixStore:
    """A group's keys in the trainer's store: found only with the group's secret."""
    return PrefixStore(f"weight_sync/{group_name}/{secret}/", store)


def _short(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:limit]
