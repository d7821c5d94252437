"""`PushReceiver`: one worker's side of the push protocol, written once over a weight target
(weight_sync/engine_side/targets.py). A push is all or nothing:

1. check the manifest against the target (names, tied aliases, shapes, dtypes, layout) and take
   staging memory for it; mark this worker ready in the group's store;
2. manifest vote: if any rank refuses, every rank stops before a byte moves;
3. receive every bucket into the staging buffer, laid out like the manifest (the target's commit is
   planned while they arrive); the engine keeps serving the previous weights untouched;
4. commit vote: only when every rank holds every byte does any rank commit (one worker: its own
   receive says it all); then the engine's derived copies (prepacked, 8-bit) are made from the
   staged weights (`WeightTarget.derive`), the old weights and copies still serving;
5. commit: the target takes the planned `(name, tensor)` pairs, and their derived copies.

A transfer that fails or times out leaves the previous weights serving, tears the broken group
down and raises; the next `join` forms a fresh group. The group is one source of the staging
buffer; a trainer's shared buffer and a push directory (weight_sync/engine_side/local_receive.py) fill the
same buffer and commit the same way. `receive_inplace` is the one way that skips staging (an
engine with no room for it): the target takes the pairs as the buckets arrive, and a failure after
the first write leaves the weights torn (the worker reports itself unhealthy until restarted).
"""

from __future__ import annotations


import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from weight_sync.common.delta_push import full_manifest
from weight_sync.common.digest import NONE, Digest, staged_digest
from weight_sync.common.group import GroupError, WeightSyncGroup
from weight_sync.common.manifest import Manifest
from weight_sync.common.phases import Phases
from weight_sync.common.votes import PushRefused, commit_vote, manifest_vote, mismatch_error
from weight_sync.engine_side.bucket_receive import BucketsIn, Meanwhile, timed
from weight_sync.engine_side.check_and_vote import check_push, refusal, serving, vote_status, wait_for_vote
from weight_sync.engine_side.delta_apply import DeltaApply
from weight_sync.engine_side.inplace_receive import TORN, bucket_pairs, inplace_problems, stream_failure
from weight_sync.engine_side.staging_memory import StagingPool, alloc, drop_pages
from weight_sync.engine_side.staging_sources import SharedSource
from weight_sync.engine_side.targets import CommitPlan, TornWeights, WeightTarget, sync_device

log = logging.getLogger(__name__)


@dataclass
class Arrived:
    """A push whose every byte is staged and whose commit vote passed: only its commit is left."""

    m: Manifest  # what is committed (a delta push's: the full weights it made)
    plan: CommitPlan
    t0: float  # began
    t1: float  # the manifest vote passed
    t2: float  # every byte in, commit vote passed
    plan_seconds: float
    digest: int = NONE  # of the committed bytes (weight_sync/common/digest.py)
    wire_bytes: int | None = None  # the bytes that moved, when not the committed manifest's (a delta)
    delta_seconds: dict | None = None  # a delta's: copying the base in, applying it and taking its digest
    derive_seconds: float = 0.0  # the engine's derived copies made from the staged weights
    phases: Phases = field(default_factory=Phases)  # where its seconds went, step by step


def pages_held(method):
    """`method` (of a PushReceiver, or a function taking one first) run with the host's pages held
    still (`hold_pages`): a push's staging writes, merges and derived copies go before the host's
    huge-page mover (engine/kernels/huge_pages.py)."""
    @functools.wraps(method)
    def held(self, *args, **kwargs):
        with self.hold_pages():
            return method(self, *args, **kwargs)

    return held


class PushReceiver:
    def __init__(self, target: WeightTarget, pool: StagingPool, device: torch.device, local_rank: int = 0):
        self.target = target
        self.pool = pool
        self.device = device
        self.local_rank = local_rank  # this worker's rank in its engine (vLLM's tensor parallel)
        self.group: WeightSyncGroup | None = None
        self.version: int | None = None  # last version committed by a push (None: the checkpoint's)
        self.digest = NONE  # the digest of those weights as pushed (a delta's base must have it)
        self.served_digest = NONE  # of the served weights' bytes, when known (a host copy's check)
        self.last: dict | None = None
        self.max_inflight = 4  # broadcasts posted at once
        self.torn = False  # a commit failed half way: restart this engine
        self.shared = SharedSource()  # a trainer's shared buffer, mapped once
        self.foreign_group = None  # a foreign trainer's group: vLLM's RL routes' (weight_sync/vllm/group.py) or SGLang's
        self.wait_readers = lambda: None  # until nothing reads the served weights (a background host copy)
        self.hold_pages = contextlib.nullcontext  # a context that keeps the host's pages still (its huge-page mover)
        self.pages_first = lambda tensors: None  # after a commit: the next push's memory onto huge pages first

    # -- the group --------------------------------------------------------------------------
    def join(self, host: str, port: int, world_size: int, rank: int, secret: str, timeout_s: float = 60.0,
             group_name: str = "weight-sync") -> dict:
        """Join a fresh group headed by the trainer (rank 0) as rank `rank + local_rank`."""
        my_rank = int(rank) + self.local_rank
        self.group = WeightSyncGroup.connect(host=host, port=int(port), world_size=int(world_size), rank=my_rank,
                                             group_name=group_name, secret=str(secret), timeout_s=float(timeout_s),
                                             device=self.device)
        return {"rank": my_rank, "world_size": int(world_size), "backend": self.group.backend_name,
                "group_name": group_name, "pid": os.getpid()}

    def group_for(self, group_name: str | None) -> WeightSyncGroup:
        g = self.group
        if g is None or not g.ready:
            raise RuntimeError("no weight-sync group: call init_weight_sync first (a failed push closes the group)")
        if group_name is not None and g.group_name != group_name:
            raise RuntimeError(f"weight push not taken, nothing changed: this worker is in group {g.group_name}, "
                               f"the trainer's is {group_name}; init_weight_sync again")
        return g

    def close_group(self, g: WeightSyncGroup) -> None:
        """`g` is torn down, and left if it is still this worker's group (an overlapped push's
        thread may end after a newer group formed)."""
        g.close()
        if self.group is g:
            self.group = None

    def health_problems(self) -> list[str]:
        if self.torn:
            return ["the weights are torn by an in-place push that failed half way: restart this engine"]
        g = self.group
        if g is not None and not g.ready:
            return [f"weight-sync group {g.group_name} is not usable ({g!r}): init_weight_sync again"]
        return []

    # -- a push over the group --------------------------------------------------------------
    def receive(self, manifest, group_name: str | None = None) -> dict:
        """Steps 1-5 over this worker's group. Raises PushRefused (a ValueError: nothing changed,
        the group still usable) or RuntimeError (nothing changed, the group closed)."""
        g = self.group_for(group_name)
        return self.commit(self.arrive(g, manifest, group_name), "broadcast")

    @pages_held
    def arrive(self, g: WeightSyncGroup, manifest, group_name: str | None, on_staging=None) -> Arrived:
        """Steps 1-4; `on_staging(staging)` is told the buffer as soon as it exists."""
        t0 = time.perf_counter()
        phases = Phases()
        m, staging, problems = self._check_and_stage(manifest, phases)
        if on_staging is not None:
            on_staging(staging)
        if group_name is not None and m is not None:
            self._wait_for_vote(g, m, staging)
        phases.mark("gate")
        self._vote(g, m, staging, problems)
        phases.mark("vote")
        t1 = time.perf_counter()
        if m.delta is not None:
            return self._receive_delta(g, m, staging, t0, t1, phases)
        plan, plan_seconds, digest = self._receive_buckets(g, m, staging, phases)
        return derived(self.target, Arrived(m, plan, t0, t1, time.perf_counter(), plan_seconds, digest,
                                             phases=phases))

    @pages_held
    def arrive_foreign(self, g, manifest, on_staging=None) -> Arrived:
        """A push from a foreign trainer (vLLM's RL routes, weight_sync/vllm/group.py; SGLang's,
        weight_sync/sglang/group.py): checked and staged as ours, then every packed chunk received;
        no vote (that trainer casts none)."""
        t0 = time.perf_counter()
        m, staging, problems = self._check_and_stage(manifest)
        if on_staging is not None:
            on_staging(staging)
        if problems:
            raise PushRefused("weight update refused, nothing changed: " + "; ".join(problems))
        t1 = time.perf_counter()
        try:
            for k, b in enumerate(m.buckets):  # an empty chunk is broadcast too
                g.receive(staging[b.start:b.end], f"receiving chunk {k} of {len(m.buckets)}")
            sync_device(self.device)
        except Exception as e:
            g.close()
            self.pool.give_back(staging)
            raise RuntimeError(f"weight update of version {m.version} failed: {e}. Nothing was committed: "
                               f"{self._serving()} still serving; init_weight_transfer_engine again") from None
        plan, plan_s = timed(self.target.plan, m, staging)
        return derived(self.target, Arrived(m, plan, t0, t1, time.perf_counter(), plan_s, staged_digest(m, staging)))

    def _receive_delta(self, g: WeightSyncGroup, m: Manifest, result: torch.Tensor, t0: float, t1: float,
                       phases: Phases) -> Arrived:
        """A delta push (weight_sync/common/delta_push.py): its payload into a buffer of its own
        while the served weights are copied into `result`, then applied there; the commit vote is
        on the result's digest."""
        full = full_manifest(m)
        made = DeltaApply(m, full, result, self.target.base(full))
        try:
            payload = alloc(m.layout_bytes, self.device)
        except Exception:
            self.close_group(g)
            self.pool.give_back(result)
            raise
        plan, plan_seconds, digest = self._receive_buckets(g, m, payload, phases, made.copy_base, made.digest_of,
                                                           lambda: self.target.plan(full, result), keep=result)
        return derived(self.target, Arrived(full, plan, t0, t1, time.perf_counter(), plan_seconds, digest,
                                             m.total_bytes, made.seconds, phases=phases),
                        {p.tensor for p in m.delta.parts})

    def commit(self, a: Arrived, transport: str, buckets: int | None = None) -> dict:
        """Step 5, and the push's record (version, sizes, timings)."""
        a.phases.mark("finish")  # staged until the engine's loop took the commit
        if not a.plan.swap:  # a copy commit writes the served weights in place
            self.wait_readers()
        try:
            freed = self.target.commit(a.m, a.plan)
        except TornWeights as e:
            self.torn = True
            raise TornWeights(f"the commit of version {a.m.version} failed half way: {TORN}; this engine must be "
                              f"restarted ({e})") from None
        self.pool.give_back(freed)
        served = getattr(self.target, "served_whole", lambda: None)()
        self.pool.keep_named(served[1] if served else None)
        if freed is None:  # the weights it replaced were no buffer of ours (the checkpoint's): the next
            self.pool.prepare(a.m.layout_bytes)  # push's staging is made now, while the engine serves
        self.pages_first([t for t in (self.pool.spare, *getattr(self.target, "spare_memory", list)()) if t is not None])
        buckets = len(a.m.buckets) if buckets is None else buckets
        # an adapter merged into the weights: they are no pushed layout's any more
        # ... nor are a part's (the other parameters are another push's)
        self.digest = a.digest if a.m.adapter is None and not a.m.partial else NONE
        # ... and of the served weights' own bytes, where the commit swapped the pushed ones in (a copy
        # commit may cast them): what a host copy linking the buffer says it holds
        self.served_digest = self.digest if a.plan.swap else NONE
        a.phases.mark("commit")
        out = self._done(a.m, a.t0, a.t1, a.t2, transport, buckets, a.plan_seconds, a.derive_seconds)
        out["phases"] = self.last["phases"] = a.phases.seconds
        if a.wire_bytes is not None:
            self.last.update(bytes=a.wire_bytes, delta=True, **(a.delta_seconds or {}))
            out = dict(self.last)
        return out

    def _check(self, manifest) -> tuple[Manifest | None, list[str]]:
        return check_push(manifest, self.target, self.version, self.digest)

    def _check_and_stage(self, manifest, phases: Phases | None = None
                         ) -> tuple[Manifest | None, torch.Tensor | None, list[str]]:
        """The manifest checked, and staging memory for it (a worker that cannot hold the push
        refuses it too); a delta's staging holds the weights it makes."""
        phases = phases or Phases()
        m, problems = self._check(manifest)
        phases.mark("check")
        staging = None
        if not problems:
            need = m.layout_bytes if m.delta is None else m.delta.full_bytes
            try:
                staging = self.pool.take(need)
            except Exception as e:
                problems = [f"cannot allocate {need} bytes of staging memory: {e}"]
        phases.mark("staging")
        return m, staging, problems

    def _wait_for_vote(self, g: WeightSyncGroup, m: Manifest, staging) -> None:
        """Mark this worker ready for the push's vote and wait until the trainer opens it (every
        rank is there); a push called off meanwhile (a rank of the group went) or a trainer gone
        ends here, nothing changed, instead of in a vote that would wait out the group's timeout."""
        why = wait_for_vote(g, m.push_id)
        if why is None:
            return
        self.close_group(g)
        self.pool.give_back(staging)
        raise RuntimeError(f"weight push of version {m.version} called off before any byte moved, nothing "
                           f"changed; the group is closed: {why}")

    def _vote(self, g: WeightSyncGroup, m: Manifest | None, staging, problems: list[str]) -> None:
        """Cast this worker's manifest vote; raises unless every rank accepted the same manifest."""
        try:
            verdict = manifest_vote(g, vote_status(problems), m.digest() if m is not None else 0)
        except GroupError as e:
            self.close_group(g)
            self.pool.give_back(staging)
            raise RuntimeError(f"weight push failed at the manifest vote, nothing changed; the group is closed: {e}")
        why = refusal(m, problems, verdict)
        if why is not None:
            self.pool.give_back(staging)
            raise PushRefused(why)

    def _receive_buckets(self, g: WeightSyncGroup, m: Manifest, staging: torch.Tensor, phases: Phases,
                         meanwhile=None, digest_of=None, planner=None, keep: torch.Tensor | None = None
                         ) -> tuple[CommitPlan, float, int]:
        """Every bucket into staging (`max_inflight` broadcasts in flight; the commit is planned
        while the first ones arrive, unless it needs the bytes), then the commit vote on the
        digest of what arrived. On any failure: nothing committed, the group closed, RuntimeError.
        A delta push passes what it does `meanwhile` (copy its base), how its result's digest is
        taken once every byte is in, its `planner`, and `keep`, its result buffer (the pool's)."""
        planner = planner or (lambda: self.target.plan(m, staging))
        early = digest_of is None and not self.target.plan_needs_bytes(m)
        jobs = Meanwhile([meanwhile, early and planner], planner)  # done while the first buckets arrive
        incoming = BucketsIn(g, m, staging, self.max_inflight, hash_landed=digest_of is None, phases=phases)
        try:
            incoming.receive(jobs.run)
            phases.mark("buckets")
            digest = incoming.digest() if digest_of is None else digest_of(staging)
            # an adapter is merged once every byte is in, before the commit vote
            plan, plan_s = jobs.plan or timed(planner)
            phases.mark("digest_and_plan")
            if bad := commit_vote(g, digest):  # commit only if every rank holds the bytes the trainer sent
                raise GroupError(mismatch_error(m.version, bad))
            phases.mark("commit_vote")
        except Exception as e:
            self._give_up_transfer(g, m, incoming, staging if keep is None else keep, e)
        return plan, plan_s, digest

    def _give_up_transfer(self, g: WeightSyncGroup, m: Manifest, incoming: BucketsIn, kept: torch.Tensor,
                          e: Exception) -> NoReturn:
        """A transfer that failed: the trainer told (down a chain it may be sending into a rank that
        stopped reading), the staging memory back, the group closed; raises RuntimeError."""
        if g.chain is not None:
            try:
                g.mark_worker_failed(m.push_id)
            except Exception as mark_error:  # noqa: BLE001 - the trainer then waits for its timeout
                log.warning("could not tell the trainer this rank gave push %s up: %s", m.push_id, mark_error)
        if incoming.inflight:  # broadcasts still posted into it: its pages go now, while closing waits for gloo
            drop_pages(incoming.staging)
        self.close_group(g)  # once closed, nothing writes into staging any more: it may be kept
        self.pool.give_back(kept)
        raise RuntimeError(
            f"weight push of version {m.version} failed after {incoming.received} of "
            f"{sum(b.nbytes for b in m.buckets)} bytes: {e}. "
            f"Nothing was committed: {self._serving()} still serving. The group is closed; init_weight_sync again."
        ) from None

    def _serving(self) -> str:
        return serving(self.version)

    def _done(self, m: Manifest, t0: float, t1: float, t2: float, transport: str, buckets: int,
              plan_seconds: float = 0.0, derive_seconds: float = 0.0) -> dict:
        t3 = time.perf_counter()
        self.version = m.version
        self.last = {"version": m.version, "bytes": m.total_bytes, "buckets": buckets, "seconds": t3 - t0,
                     "receive_seconds": t2 - t1, "commit_seconds": t3 - t2, "plan_seconds": plan_seconds,
                     "derive_seconds": derive_seconds, "transport": transport}
        return dict(self.last)

    # -- no staging: in place ---------------------------------------------------------------
    def receive_inplace(self, manifest, group_name: str | None = None) -> dict:
        """Steps 1-2 without staging, then each bucket into a buffer of one bucket and on to the
        target as pairs, the commit vote last. Raises PushRefused (nothing changed) for a refused
        push, RuntimeError naming TORN once a failure came after the first write."""
        g = self.group_for(group_name)
        t0 = time.perf_counter()
        m, problems = self._check(manifest)
        problems = inplace_problems(m, problems)
        if group_name is not None and m is not None:
            self._wait_for_vote(g, m, None)
        self._vote(g, m, None, problems)
        t1 = time.perf_counter()
        self.wait_readers()
        written, digest = [0], Digest()
        try:
            self.target.commit_stream(m, bucket_pairs(g, m, self.device, written, digest))
        except Exception as e:
            self.close_group(g)
            failure = stream_failure(m, written[0], e)
            if isinstance(failure, TornWeights):
                self.torn = True
            raise failure from None
        self.torn = False
        self.digest, self.served_digest = digest.value(), NONE
        return self._done(m, t0, t1, time.perf_counter(), "broadcast, in place", written[0])


def derived(target: WeightTarget, a: Arrived, changed: set[int] | None = None) -> Arrived:
    """Step 4's end: the engine's derived copies made from the staged weights (`changed`: the
    indices of the tensors a delta changed), timed."""
    a.derive_seconds = timed(target.derive, a.m, a.plan, changed)[1]
    a.phases.mark("derive")
    return a
