"""Process groups for weight sync that never touch the trainer's default group.

A group is a raw c10d backend object (`ProcessGroupGloo` for CPU tensors, `ProcessGroupNCCL` for
CUDA tensors) built on a `TCPStore` + `PrefixStore` of its own, as vLLM's
`stateless_init_torch_distributed_process_group` does. Nothing is registered with
`torch.distributed`'s global state, so a trainer that has its own default group (DDP, FSDP,
accelerate) keeps it untouched, and a group can be torn down and formed again at will.

Collectives are called on the backend object itself with group ranks, so the "broadcast needs
global ranks" limitation of wrapping a stateless group in `dist.broadcast` does not apply. A
push's buckets go down a chain when the workers span hosts (weight_sync.common.fan_out).

Who may join: the store listens on the host the trainer gave (loopback by default) and every key
of a group lives under a prefix holding a per-group secret (weight_sync/common/group_store.py,
with the gates and marks a push keeps there).

Roles: the trainer is rank 0 and hosts the `TCPStore` (port 0 picks a free port); each
engine worker joins as a store client with rank `rank_offset + local index`. Every generation of
a group gets a fresh name (the store prefix) and a fresh store, so keys of a dead generation can
never be mistaken for the next one. Every blocking step has a timeout: connecting to the store,
the rendezvous, every collective.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
import uuid

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

from weight_sync.common import store_gates as gates
from weight_sync.common.devices import device_identity, duplicate_gpus, normalize_device
from weight_sync.common.fan_out import ChainRelay, cut_pair, fan_out_mode, plan_chain
from weight_sync.common.group_store import GroupError, GroupStore, _short, _td, create_master_store
from weight_sync.common.hosts import gloo_device

log = logging.getLogger(__name__)

_META_KEY = "meta"


def backend_for_device(device: torch.device | str) -> str:
    """The backend that moves tensors living on `device`: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def new_group_name(prefix: str = "weight-sync") -> str:
    """A fresh store prefix: one per generation of a group."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


RENDEZVOUS_S = 10.0  # gloo's connects of a forming group (see _make_backend)


def _make_backend(backend: str, store, rank: int, world_size: int, timeout_s: float, host: str):
    if backend == "gloo":
        from torch._C._distributed_c10d import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        # The context's timeout bounds the rendezvous's connects, which cannot be interrupted: a rank that
        # published its address and died is retried for that long. Every rank passed the forming gate,
        # so a live one connects in well under a second; every collective passes its own timeout.
        opts._timeout = _td(min(timeout_s, RENDEZVOUS_S))
        opts._devices = [gloo_device(ProcessGroupGloo, host)]
        opts._threads = 2
        return ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        # A stalled peer must surface as an error on wait(), not tear the engine process down
        # (the watchdog's default). 2 = CleanUpOnly: abort the communicators, raise on wait.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        opts = ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = _td(timeout_s)
        return ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"unknown backend {backend!r}; expected 'gloo' or 'nccl'")


class WeightSyncGroup(GroupStore):
    """One generation of a weight-sync group, seen from one rank: its store (GroupStore: keys,
    gates, marks) and its backend (the rendezvous, the collectives).

    `WeightSyncGroup.master(...)` on the trainer (rank 0) creates the store; `.join()` then blocks
    until every rank has joined. Workers call `WeightSyncGroup.connect(...)`, which blocks the same
    way. Both sides must run concurrently (the trainer in a thread while it awaits the workers'
    RPCs, see `weight_sync.trainer.local_engines`).
    """

    def __init__(self, *, host: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float,
                 device: torch.device | str, secret: str, store: TCPStore | None = None):
        if world_size < 2:
            raise ValueError(f"a weight-sync group needs the trainer and at least one worker; world_size={world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        super().__init__(host=host, port=port, world_size=world_size, rank=rank, group_name=group_name,
                         timeout_s=timeout_s, secret=secret, store=store)
        self.device = normalize_device(device)
        self.backend_name = backend_for_device(self.device)
        self._pg = None
        self.chain: list[int] | None = None  # the buckets' chain in rank order (common.fan_out); None: broadcast
        self._relay: ChainRelay | None = None
        self.closed = False
        self.aborted = False  # abort(): no collective starts any more; close() still to come

    # -- forming ----------------------------------------------------------------------------
    @classmethod
    def master(cls, *, host: str = "127.0.0.1", port: int = 0, world_size: int, timeout_s: float = 60.0,
               device: torch.device | str = "cpu", group_name: str | None = None) -> WeightSyncGroup:
        """Rank 0: create the store now (so the port is known), rendezvous later with `join()`."""
        store = create_master_store(host, port, world_size, timeout_s)
        g = cls(host=host, port=store.port, world_size=world_size, rank=0, group_name=group_name or new_group_name(),
                timeout_s=timeout_s, device=device, secret=secrets.token_hex(16), store=store)
        prefix = g._prefix_store()
        prefix.set(_META_KEY, json.dumps({"backend": g.backend_name, "world_size": g.world_size,
                                          "fan_out": fan_out_mode()}))
        return g

    @classmethod
    def connect(cls, *, host: str, port: int, world_size: int, rank: int, group_name: str, secret: str,
                timeout_s: float = 60.0, device: torch.device | str = "cpu") -> WeightSyncGroup:
        """Ranks >= 1: connect to the trainer's store and rendezvous (blocks until all ranks joined).
        `secret` is the one in the trainer's `connection_info()`: without it nothing is found."""
        g = cls(host=host, port=port, world_size=world_size, rank=rank, group_name=group_name, timeout_s=timeout_s,
                device=device, secret=secret)
        try:
            g._store = TCPStore(host, int(port), None, False, _td(timeout_s))
        except Exception as e:
            raise GroupError(f"cannot reach the weight-sync store at {host}:{port} within {timeout_s}s: {e}") from e
        g.join()
        return g

    def connection_info(self) -> dict:
        """What a worker needs to join (msgpack-able). Holds the group's secret: send it only
        over an authenticated channel, never log it."""
        return {"host": self.host, "port": self.port, "world_size": self.world_size, "group_name": self.group_name,
                "timeout_s": self.timeout_s, "secret": self._secret}

    def join(self) -> WeightSyncGroup:
        """Check the group's metadata, claim this rank, then form the backend (blocks for every rank)."""
        if self._pg is not None:
            return self
        if self.closed:
            raise GroupError("this weight-sync group was closed; form a new one")
        t0 = time.monotonic()
        prefix = self._prefix_store()
        try:
            meta = json.loads(prefix.get(_META_KEY))  # blocks until rank 0 set it (under the secret), or times out
            claims = prefix.add(f"rank/{self.rank}", 1)
        except Exception as e:
            raise GroupError(f"weight-sync group {self.group_name!r}: no answer from the store within "
                             f"{self.timeout_s}s: {e}") from e
        if meta["world_size"] != self.world_size:
            raise GroupError(f"world_size mismatch: rank 0 formed a group of {meta['world_size']}, "
                             f"rank {self.rank} was told {self.world_size}")
        if meta["backend"] != self.backend_name:
            raise GroupError(f"backend mismatch: rank 0 uses {meta['backend']}, rank {self.rank} (on {self.device}) "
                             f"would use {self.backend_name}; trainer and engines must hold the weights on the "
                             "same kind of device")
        if claims != 1:
            raise GroupError(f"rank {self.rank} was claimed twice in group {self.group_name!r}: check the rank "
                             "offsets of the engines / sidecars")
        self._pass_forming_gate(prefix)
        # past the gate, every wait for the others ends if the forming is called off (a rank went meanwhile)
        gated = gates.GatedStore(prefix, prefix, gates.FORMING, self.timeout_s)
        if self.backend_name == "nccl":
            self._check_placement(gated)
        try:
            self._pg = _make_backend(self.backend_name, PrefixStore("pg/", gated), self.rank, self.world_size,
                                     self.timeout_s, self.host)
        except Exception as e:
            raise GroupError(f"weight-sync group {self.group_name!r}: rank {self.rank} could not rendezvous with "
                             f"{self.world_size} ranks within {self.timeout_s}s: {e}") from e
        if self.closed:  # closed by another thread while we waited for the others
            self.close()
            raise GroupError(f"weight-sync group {self.group_name!r} was closed while forming")
        if self.backend_name == "nccl":
            self._connect()
        else:
            self._form_chain(gated, meta.get("fan_out", "auto"))
        log.info("rank %d/%d joined weight-sync group %s (%s%s) in %.2fs", self.rank, self.world_size,
                 self.group_name, self.backend_name, f", buckets down the chain {self.chain}" if self.chain else "",
                 time.monotonic() - t0)
        return self

    def _pass_forming_gate(self, prefix: PrefixStore) -> None:
        """Every rank arrives before the rendezvous, which cannot be interrupted: a rank that goes
        first has the trainer call the forming off (call_off_forming), and nobody waits for it."""
        try:
            gates.arrive(prefix, gates.FORMING, self.world_size)
            formed = gates.wait_go(self._waits(), gates.FORMING, self.timeout_s)
        except Exception as e:
            raise GroupError(f"weight-sync group {self.group_name!r}: not every rank came within {self.timeout_s}s: "
                             f"{_short(e)}") from e
        if not formed:
            raise GroupError(f"weight-sync group {self.group_name!r} was called off while forming: a rank of it went")

    def _form_chain(self, prefix, mode: str) -> None:
        try:
            self.chain = plan_chain(prefix, self.rank, self.world_size, self.host, self.timeout_s, mode)
        except Exception as e:
            self.close()
            raise GroupError(f"weight-sync group {self.group_name!r}: not every rank said where it runs within "
                             f"{self.timeout_s}s: {_short(e)}") from e
        if self.chain is not None:
            self._relay = ChainRelay(self._pg, self.chain, self.rank, self.timeout_s)

    def _connect(self) -> None:
        """NCCL creates its communicators at the first collective: one small broadcast here, so
        an unreachable peer, a bad IB/P2P setup or a duplicate GPU fails the group's forming,
        named, instead of the first push's vote."""
        try:
            self.wait(self.broadcast(torch.zeros(1, device=self.device)), "connecting the NCCL communicator")
        except GroupError:
            self.close()
            raise

    def _check_placement(self, prefix) -> None:
        """Every rank publishes its device and reads everyone's: two ranks on one GPU are named
        here, before NCCL forms a communicator that would refuse them (or hang until the timeout)."""
        prefix.set(f"device/{self.rank}", json.dumps(device_identity(self.device)))
        keys = [f"device/{r}" for r in range(self.world_size)]
        try:
            prefix.wait(keys, _td(self.timeout_s))
            identities = {r: json.loads(prefix.get(k)) for r, k in enumerate(keys)}
        except Exception as e:
            raise GroupError(f"weight-sync group {self.group_name!r}: not every rank said where it runs within "
                             f"{self.timeout_s}s: {_short(e)}") from e
        problems = duplicate_gpus(identities)
        if problems:
            raise GroupError(f"weight-sync group {self.group_name!r} cannot form: " + "; ".join(problems))

    @property
    def ready(self) -> bool:
        return self._pg is not None and not self.closed and not self.aborted

    # -- collectives ------------------------------------------------------------------------
    def _backend(self):
        if not self.ready:
            raise GroupError("the weight-sync group is not formed (or was closed)")
        return self._pg

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start a broadcast of `tensor` (contiguous, on this group's device); returns the Work."""
        return self._backend().broadcast(tensor, root=src, timeout=_td(self.timeout_s))

    def fan_out(self, tensor: torch.Tensor):
        """Start sending (rank 0) or receiving one bucket of a push: down the chain when the
        workers span hosts (weight_sync.common.fan_out), else a broadcast. Returns the Work."""
        if self._relay is not None:
            self._backend()
            return self._relay.submit(tensor)
        return self.broadcast(tensor, src=0)

    def cut_links(self) -> None:
        """Close this rank's link to every other rank now, from any thread: a collective it waits in
        with a rank that will never come (a commit vote past a lost host) fails at once, not at
        the timeout. Gloo's; NCCL's waits end with abort()."""
        if self._pg is not None and self.backend_name == "gloo":
            for peer in range(self.world_size):
                if peer != self.rank:
                    cut_pair(self._pg, peer)

    def cut_chain(self) -> None:
        """Close this rank's link to the next one down the chain now (weight_sync.common.fan_out)."""
        if self._relay is not None:
            self._relay.cut_next()

    def wait(self, work, what: str = "collective") -> None:
        try:
            work.wait(_td(self.timeout_s))
        except Exception as e:
            raise GroupError(f"{what} failed on rank {self.rank}: {_short(e)}") from e

    def allreduce_max(self, tensor: torch.Tensor, what: str = "allreduce") -> torch.Tensor:
        """Blocking element-wise MAX over every rank of a small int64 tensor (votes).

        Done as an all-gather and a local max: gloo's all-reduce of a few integers takes ~1 ms on
        loopback, its all-gather ~0.25 ms (measured, bench/RESULTS.md), and every push votes."""
        return self.allgather(tensor, what).amax(0).reshape(tensor.shape)

    def allgather(self, tensor: torch.Tensor, what: str = "allgather") -> torch.Tensor:
        """Blocking: every rank's small int64 tensor, one row per rank (on the CPU)."""
        t = tensor.to(self.device).reshape(-1)
        gathered = [torch.empty_like(t) for _ in range(self.world_size)]
        try:
            work = self._backend().allgather(gathered, t, timeout=_td(self.timeout_s))
        except Exception as e:
            raise GroupError(f"{what} failed on rank {self.rank}: {_short(e)}") from e
        self.wait(work, what)
        return torch.stack(gathered).cpu()

    def synchronize(self) -> None:
        """Wait for the device work this thread's collectives ordered: NCCL's waits make the
        calling thread's current stream wait for them, so that stream is synchronized (a
        receiving thread on a side stream does not wait for the forward's kernels, nor they for it)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- teardown ---------------------------------------------------------------------------
    def abort(self) -> None:
        """Stop the group from outside the thread that waits in it, without blocking: no
        collective starts any more, and on NCCL the waits in flight fail now. Gloo's cannot be
        interrupted (they end at the timeout), and dropping a gloo backend joins its threads,
        which wait that long: so the backend is kept, and the waiting thread close()s it."""
        if self.closed or self.aborted:
            return
        self.aborted = True
        if self._pg is not None:
            try:
                self._pg.abort()
            except Exception:  # a broken group may refuse: what matters is that nothing new starts
                pass

    def close(self) -> None:
        """Tear the group down; safe to call on a broken group, never waits for a peer. It does
        wait for a gloo wait in flight on another thread (freeing the backend joins its threads):
        from outside that thread, abort()."""
        if self.closed:
            return
        self.closed = True
        relay, self._relay = self._relay, None  # it holds the backend too: dropped, the backend's pairs close
        if relay is not None:
            relay.close()
        pg, self._pg = self._pg, None
        if pg is not None:
            for method in ("abort", "shutdown"):
                try:
                    getattr(pg, method)()
                except Exception:  # a broken group may refuse either: dropping it is what matters
                    pass
        self._store = self._wait_store = None

    def __repr__(self) -> str:
        state = "ready" if self.ready else ("closed" if self.closed else "aborted" if self.aborted else "pending")
        return (f"WeightSyncGroup({self.group_name}, rank {self.rank}/{self.world_size}, {self.backend_name}, "
                f"{self.host}:{self.port}, {state})")
