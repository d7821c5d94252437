"""Engine side: `WeightSyncExtension`, mixed into the engine's worker through
`EngineConfig(worker_extension_cls="weight_sync.receiver:WeightSyncExtension")`. Its public methods
are reached with `collective_rpc`; arguments and results are msgpack builtins.

A push is all or nothing:

1. validate the manifest against this worker's model (names, tied aliases, shapes, dtypes,
   layout) and vote: if any rank refuses, every rank stops before a byte moves;
2. receive every bucket into a staging buffer laid out like the manifest (one flat buffer, the
   size of the pushed weights); the model keeps serving the previous weights untouched;
3. commit vote: only when every rank holds every byte does any rank commit (with a single
   worker its own receive says it all: no vote);
4. commit: each parameter is pointed at its slice of the staging buffer (`param.data = view`,
   no copy; the previous storage is released) or, when a dtype cast is needed or
   `commit="copy"` was asked for, copied into (`param.copy_(view)`).

A transfer that fails or times out (trainer died, stalled, a peer vanished) leaves the previous
weights serving, tears the broken group down and raises; the next `init_weight_sync` forms a
fresh group and the next push is accepted.

Memory: a push holds one extra copy of the pushed weights (the staging buffer) until it
commits. With `commit="swap"` (default) the staging buffer becomes the weights and the old
weights are freed at commit; with `commit="copy"` the staging buffer is freed after the copy.
`keep_staging=True` (the default on CPU) keeps the buffer the commit freed for the next push
instead (one extra copy of the weights held for good): fresh memory costs page faults that on
CPU are slower than the network, see weight_sync/README.md. `close_weight_sync()` drops it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from weight_sync.adapter_receive import NEEDS_BASE, AdapterReceive
from weight_sync.checksum import weights_checksum as _checksum
from weight_sync.devices import normalize_device
from weight_sync.group import GroupError, WeightSyncGroup
from weight_sync.inplace_receive import InplaceReceive
from weight_sync.manifest import (
    DTYPES,
    Manifest,
    model_params,
    param_infos,
    validate_manifest,
)
from weight_sync.overlapped_receive import OverlappedReceive
from weight_sync.staging_memory import alloc, drop_pages, st_dtype, whole
from weight_sync.votes import (
    VOTE_NEEDS_BASE,
    VOTE_OK,
    VOTE_REFUSED,
    PushRefused,
    commit_vote,
    manifest_vote,
)

log = logging.getLogger(__name__)

COMMIT_MODES = ("swap", "copy")


@dataclass
class _SyncState:
    group: WeightSyncGroup | None = None
    version: int | None = None  # last version committed by weight sync (None: the checkpoint's)
    last: dict | None = None
    keep_staging: bool = False
    commit: str = "swap"
    spare: torch.Tensor | None = None  # a staging buffer kept for the next push (keep_staging)
    current: tuple[int, int] | None = None  # (data_ptr, nbytes) of the staging buffer the weights live in
    max_inflight: int = 4
    # (weakref to the model, manifest layout) of the last manifest that passed validation: the
    # next push of a training run has the same layout and skips the walk over the model. The
    # engine changes parameters' shapes only through a new model object (reload_weights) or by
    # releasing them (sleep level 2, refused before this check).
    validated: tuple | None = None
    shared: tuple | None = None  # (handle key, mapped tensor) of the trainer's shared buffer (weight_sync.shared)
    staged: object = None  # an overlapped push (weight_sync.overlapped_receive), until committed or dropped
    # LoRA (weight_sync.adapter_receive): the base adapters are merged into, once a push brought it
    base_id: str | None = None
    w0: dict | None = None  # target weight name -> its base tensor
    lora_spare: dict | None = None  # target weight name -> a buffer for its next merge (keep_staging)
    torn: bool = False  # an in-place push failed after writing (weight_sync.inplace_receive): restart
    saves: dict = field(default_factory=dict)  # path -> (thread, outcome) of a background save_weights


class WeightSyncExtension(OverlappedReceive, AdapterReceive, InplaceReceive):
    """Worker extension (no __init__: the worker's own constructor runs; state lives in
    `self._ws_state`). Uses the worker's `self.model`, `self.device`, `self.cfg`."""

    # -- state ------------------------------------------------------------------------------
    def _ws(self) -> _SyncState:
        st = getattr(self, "_ws_state", None)
        if st is None:
            # CPU: keep the staging buffer between pushes, fresh pages cost more than the transfer;
            # CUDA: the caching allocator already reuses freed blocks.
            st = self._ws_state = _SyncState(keep_staging=self.device.type == "cpu")
        return st

    def _ws_local_rank(self) -> int:
        return int(getattr(self, "local_rank", 0))  # one worker per engine today

    # -- RPC: group -------------------------------------------------------------------------
    def init_weight_sync(self, host: str, port: int, world_size: int, rank: int, secret: str, timeout_s: float = 60.0,
                         group_name: str = "weight-sync", keep_staging: bool | None = None,
                         commit: str | None = None) -> dict:
        """Join a fresh weight-sync group headed by the trainer (rank 0). `rank` is this engine's
        rank offset: its worker i takes rank `rank + i`; `secret` is the group's (from the
        trainer's connection info). Any previous group is closed first. Blocks until every rank
        joined or `timeout_s` passed."""
        st = self._ws()
        if commit is not None and commit not in COMMIT_MODES:
            raise ValueError(f"commit must be one of {COMMIT_MODES}, got {commit!r}")
        self.close_weight_sync(drop_staging=False)
        if keep_staging is not None:
            st.keep_staging = bool(keep_staging)
            if not st.keep_staging:
                st.spare = None
        if commit is not None:
            st.commit = commit
        my_rank = int(rank) + self._ws_local_rank()
        st.group = WeightSyncGroup.connect(host=host, port=int(port), world_size=int(world_size), rank=my_rank,
                                           group_name=group_name, secret=str(secret), timeout_s=float(timeout_s),
                                           device=self.device)
        return {"rank": my_rank, "world_size": int(world_size), "backend": st.group.backend_name,
                "group_name": group_name, "pid": os.getpid()}

    def close_weight_sync(self, drop_staging: bool = True) -> bool:
        """Leave the group (if any); frees a kept staging buffer too unless told not to. An
        overlapped push still arriving over that group is given up: its staging memory goes now
        (weight_sync.overlapped_receive)."""
        st = self._ws()
        g, st.group = st.group, None
        staged = st.staged
        if staged is not None and staged.group is g and staged.thread.is_alive():
            self._ws_give_up(staged)
        elif g is not None:
            g.close()
        if drop_staging:
            st.spare = None
            st.shared = None
            if staged is not None and not staged.thread.is_alive():
                st.staged = None  # a push staged but never finished: nobody will commit it now
        return True

    def weight_sync_info(self) -> dict:
        st = self._ws()
        return {
            "group": repr(st.group) if st.group is not None else None,
            "group_name": st.group.group_name if st.group is not None else None,
            "ready": bool(st.group is not None and st.group.ready),
            "version": st.version,
            "last": st.last,
            "keep_staging": st.keep_staging,
            "commit": st.commit,
            "spare_bytes": int(st.spare.numel()) if st.spare is not None else 0,
        }

    # -- hooks the worker calls (private: not RPCs) ----------------------------------------
    def _health_problems(self) -> list[str]:
        st = self._ws()
        if st.torn:
            return ["the weights are torn by an in-place push that failed half way: restart this engine"]
        g = st.group
        if g is not None and not g.ready:
            return [f"weight-sync group {g.group_name} is not usable ({g!r}): init_weight_sync again"]
        return []

    def _on_weights_released(self) -> None:
        st = self._ws()
        st.base_id, st.w0, st.lora_spare, st.spare, st.current = None, None, None, None, None

    def _weights_reloaded(self) -> None:
        st = self._ws()
        st.version, st.current = None, None  # the checkpoint's weights again, in storage of their own
        st.base_id, st.w0, st.lora_spare = None, None, None

    # -- RPC: checks ------------------------------------------------------------------------
    def weights_checksum(self) -> str:
        """See weight_sync.checksum: SHA-256 over every parameter (tied ones once) in name order.
        With unmerged LoRA (engine/lora_bank.py), of the weights with the newest adapter merged:
        what a merged engine holds, so one check fits both."""
        return _checksum(self._served_weights())

    def _served_weights(self):
        bank = getattr(self, "lora_bank", None)
        if bank is None or not bank.active:
            return self.model.named_parameters()
        return [(n, bank.merged(n.removesuffix(".weight"), p)) for n, p in self.model.named_parameters()]

    # -- RPC: pushes ------------------------------------------------------------------------
    def receive_weights(self, manifest, group_name: str | None = None) -> dict:
        """Take one push over the group (the trainer broadcasts concurrently): check -> vote ->
        receive buckets -> commit. Returns {"version", "bytes", "seconds", ...}. Raises PushRefused
        (a ValueError) if the push was refused (nothing changed, group still usable) or
        RuntimeError if it failed (nothing changed, group closed: init_weight_sync again).
        `group_name`: the trainer's group, given by a trainer that votes only once every worker
        marked itself ready (weight_sync.push); a worker in another group (or none) fails at once."""
        g = self._ws_group(group_name)
        m, staging, plan, t0, t1, t2 = self._ws_arrive(g, manifest, group_name)
        self._ws_commit(m, staging, plan)
        del plan
        return self._ws_done(m, t0, t1, t2, "broadcast", len(m.buckets))

    def _ws_arrive(self, g: WeightSyncGroup, manifest, group_name: str | None, on_staging=None) -> tuple:
        """Check and stage, mark ready, vote, receive every bucket, commit vote: everything of a
        push but its commit. Returns (manifest, staging, commit plan, t0, t1, t2); raises as
        receive_weights does. `on_staging(staging)` is told the buffer as soon as it exists."""
        t0 = time.perf_counter()
        m, staging, problems = self._ws_check_and_stage(manifest)
        if on_staging is not None:
            on_staging(staging)
        if group_name is not None and m is not None:
            self._ws_mark_ready(g, m.push_id)
        self._ws_vote(g, m, staging, problems)
        t1 = time.perf_counter()
        plan = self._ws_receive(g, m, staging)
        return m, staging, plan, t0, t1, time.perf_counter()

    def _ws_close_group(self, g: WeightSyncGroup) -> None:
        """A push over `g` failed: `g` is torn down, and left if it is still this worker's group
        (an overlapped push's thread may end after a newer group formed)."""
        g.close()
        st = self._ws()
        if st.group is g:
            st.group = None

    def receive_weights_shared(self, manifest, handle: dict) -> dict:
        """A push with no process group (weight_sync.shared): map the trainer's buffer, check it
        holds the manifest's layout, copy it into staging, commit. Raises PushRefused (nothing
        changed) for a bad manifest or a buffer that cannot be mapped."""
        from weight_sync.shared import open_weights

        t0 = time.perf_counter()
        m, staging, problems = self._ws_check_and_stage(manifest)
        src = None
        if not problems:
            try:
                src = self._ws_shared_source(handle, open_weights)
                if src.numel() < m.layout_bytes:
                    problems = [f"the shared buffer holds {src.numel()} bytes, the manifest {m.layout_bytes}"]
            except Exception as e:
                problems = [f"cannot map the trainer's weights: {type(e).__name__}: {e}"]
        if problems:
            self._ws_release(staging)
            raise PushRefused("weight push refused, nothing changed: " + "; ".join(problems))
        t1 = time.perf_counter()
        staging.copy_(src[:m.layout_bytes])  # every byte is here before anything is committed
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        self._ws_commit(m, staging)
        return self._ws_done(m, t0, t1, t2, f"shared ({handle.get('kind')})", 0)

    def load_weights_from_path(self, path: str, manifest=None) -> dict:
        """The file fallback: load a push written by `weight_sync.files.write_safetensors` from
        `path` (a directory, e.g. under /dev/shm). Same validation; all tensors are read into
        staging before anything is committed, so a bad or partial file changes nothing."""
        from safetensors import safe_open

        from weight_sync.files import MANIFEST_FILE, WEIGHTS_FILE, read_manifest

        t0 = time.perf_counter()
        if manifest is None:
            manifest = read_manifest(path)
        m, problems = self._ws_check(manifest)
        if problems:
            raise ValueError("weight load refused, nothing changed: " + "; ".join(problems))
        file = os.path.join(path, WEIGHTS_FILE)
        if not os.path.isfile(file):
            raise ValueError(f"weight load refused, nothing changed: no {WEIGHTS_FILE} in {path} "
                             f"(a push directory holds {WEIGHTS_FILE} and {MANIFEST_FILE})")
        staging = self._ws_staging(m.layout_bytes)
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                keys = set(f.keys())
                if keys != set(m.names):
                    extra, lacking = sorted(keys - set(m.names)), sorted(set(m.names) - keys)
                    raise ValueError(f"{WEIGHTS_FILE} does not match the manifest: extra {extra[:8]}, "
                                     f"lacking {lacking[:8]}")
                for t in m.tensors:
                    sl = f.get_slice(t.name)
                    shape, dtype = tuple(sl.get_shape()), st_dtype(sl.get_dtype())
                    if shape != tuple(t.shape) or dtype != t.dtype:
                        raise ValueError(f"{t.name}: file has {dtype} {list(shape)}, manifest says {t.dtype} "
                                         f"{list(t.shape)}")
                    if t.nbytes:
                        view = staging[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)
                        view.copy_(f.get_tensor(t.name))
        except Exception as e:
            self._ws_release(staging)
            raise ValueError(f"weight load from {path} failed, nothing changed: {e}") from None
        t1 = time.perf_counter()
        self._ws_commit(m, staging)
        return self._ws_done(m, t0, t0, t1, "safetensors", 0)

    def save_weights(self, path: str, version: int, background: bool = False) -> dict:
        """Write this worker's weights as a push directory (`weight_sync.files`) that another
        engine can `load_weights_from_path`: how a restarted engine catches up from a sibling or
        from the sidecar's host copy without the trainer. `background=True`: only a host
        snapshot is taken here (on CUDA, copies queued on a side stream into pinned memory);
        a thread writes it while the engine steps, and `saved_weights(path)` says when it is done."""
        from weight_sync.files import host_snapshot, write_tensors

        t0 = time.perf_counter()
        tensors, ready = host_snapshot(list(self._served_weights()))  # unmerged LoRA: the newest merged
        if not background:
            m = write_tensors(tensors, path, version, ready)
            return {"path": path, "bytes": m.layout_bytes, "seconds": time.perf_counter() - t0}
        saves = self._ws().saves
        done: dict = {}

        def write():
            try:
                m = write_tensors(tensors, path, version, ready)
                done["result"] = {"path": path, "bytes": m.layout_bytes, "seconds": time.perf_counter() - t0}
            except BaseException as e:  # noqa: BLE001 - handed to saved_weights
                done["error"] = f"{type(e).__name__}: {e}"

        saves[path] = (threading.Thread(target=write, name="weight-sync-save", daemon=True), done)
        saves[path][0].start()
        return {"path": path, "pending": True, "snapshot_seconds": time.perf_counter() - t0}

    def saved_weights(self, path: str) -> dict | None:
        """A background save_weights: None while it writes; its result once written; raises
        RuntimeError with its error if it failed (and forgets it either way)."""
        thread, done = self._ws().saves[path]
        if thread.is_alive():
            return None
        del self._ws().saves[path]
        if "error" in done:
            raise RuntimeError(f"writing the weights to {path} failed: {done['error']}")
        return done["result"]

    def _ws_shared_source(self, handle: dict, open_weights) -> torch.Tensor:
        """The trainer's shared buffer, mapped once and kept while the handle stays the same (a
        training run pushes from one buffer): mapping it afresh costs a page fault per page."""
        st = self._ws()
        key = tuple(sorted((k, v) for k, v in handle.items() if k in ("kind", "path", "handle", "size", "offset",
                                                                       "nbytes", "storage_offset", "device")))
        if st.shared is None or st.shared[0] != key:
            st.shared = None
            st.shared = (key, open_weights(handle))
        return st.shared[1]

    # -- the steps of a push ----------------------------------------------------------------
    def _ws_group(self, group_name: str | None) -> WeightSyncGroup:
        g = self._ws().group
        if g is None or not g.ready:
            raise RuntimeError("no weight-sync group: call init_weight_sync first (a failed push closes the group)")
        if group_name is not None and g.group_name != group_name:
            raise RuntimeError(f"weight push not taken, nothing changed: this worker is in group {g.group_name}, "
                               f"the trainer's is {group_name}; init_weight_sync again")
        return g

    def _ws_check_and_stage(self, manifest) -> tuple[Manifest | None, torch.Tensor | None, list[str]]:
        """The manifest checked against this worker's model, and staging memory for it (a worker
        that cannot hold the push refuses it too)."""
        m, problems = self._ws_check(manifest)
        staging = None
        if not problems:
            try:
                staging = self._ws_staging(m.layout_bytes)
            except Exception as e:
                problems = [f"cannot allocate {m.layout_bytes} bytes of staging memory: {e}"]
        return m, staging, problems

    def _ws_vote(self, g: WeightSyncGroup, m: Manifest | None, staging, problems: list[str]) -> None:
        """Cast this worker's manifest vote; raises unless every rank accepted the same manifest."""
        status = VOTE_OK if not problems else VOTE_NEEDS_BASE if problems[0] is NEEDS_BASE else VOTE_REFUSED
        try:
            verdict = manifest_vote(g, status, m.digest() if m is not None else 0)
        except GroupError as e:
            self._ws_close_group(g)
            self._ws_release(staging)
            raise RuntimeError(f"weight push failed at the manifest vote, nothing changed; the group is closed: {e}")
        if problems or not verdict.ok:
            self._ws_release(staging)
        if problems:
            raise PushRefused("weight push refused, nothing changed: " + "; ".join(problems))
        if verdict.worst != VOTE_OK:
            raise PushRefused(f"weight push of version {m.version} refused by another rank (the trainer or "
                              "another worker; see its error), nothing changed")
        if not verdict.same_manifest:
            raise PushRefused(f"weight push of version {m.version} refused: the ranks hold different manifests")

    def _ws_receive(self, g: WeightSyncGroup, m: Manifest, staging: torch.Tensor) -> dict:
        """Every bucket into staging (`max_inflight` broadcasts in flight; the commit is planned
        while the first ones arrive), then the commit vote. Returns the commit plan. On any
        failure: nothing committed, the group closed, RuntimeError."""
        st = self._ws()
        received, plan, inflight = 0, None, deque()
        try:
            for k, b in enumerate(m.buckets):
                if b.nbytes == 0:
                    continue
                if len(inflight) >= st.max_inflight and plan is None and m.adapter is None:
                    plan = self._ws_plan_commit(m, staging)
                while len(inflight) >= st.max_inflight:
                    received += self._ws_retire(g, inflight)
                inflight.append((g.broadcast(staging[b.start:b.end], src=0), k, b.nbytes))
            if plan is None and m.adapter is None:
                plan = self._ws_plan_commit(m, staging)
            while inflight:
                received += self._ws_retire(g, inflight)
            g.synchronize()
            if plan is None:  # an adapter is merged once every byte is in, before the commit vote
                plan = self._ws_plan_commit(m, staging)
            if not commit_vote(g):  # other workers: commit only if every one holds every byte
                raise GroupError("another rank did not receive every byte")
        except Exception as e:
            if inflight:  # broadcasts still posted into it: its pages go now, while closing waits for gloo
                drop_pages(staging)
            self._ws_close_group(g)  # once closed, nothing writes into staging any more: it may be kept
            self._ws_release(staging)
            old = "the checkpoint's weights" if st.version is None else f"version {st.version}"
            raise RuntimeError(
                f"weight push of version {m.version} failed after {received} of "
                f"{sum(b.nbytes for b in m.buckets)} bytes: {e}. "
                f"Nothing was committed: {old} still serving. The group is closed; init_weight_sync again."
            ) from None
        return plan

    def _ws_done(self, m: Manifest, t0: float, t1: float, t2: float, transport: str, buckets: int) -> dict:
        """Record a committed push (version, sizes, timings) and return it."""
        st = self._ws()
        t3 = time.perf_counter()
        st.version = m.version
        st.last = {"version": m.version, "bytes": m.total_bytes, "buckets": buckets, "seconds": t3 - t0,
                   "receive_seconds": t2 - t1, "commit_seconds": t3 - t2, "transport": transport}
        return dict(st.last)

    # -- internals --------------------------------------------------------------------------
    def _ws_check(self, manifest) -> tuple[Manifest | None, list[str]]:
        try:
            m = Manifest.from_wire(manifest)
        except Exception as e:
            return None, [f"malformed manifest: {e}"]
        if getattr(self, "weights_released", False):
            return m, ["the engine's weights are released (sleep level 2): wake_up() first"]
        if m.adapter is not None:
            return m, self._ws_check_adapter(m)
        st = self._ws()
        layout = (m.tensors, m.buckets, m.total_bytes, m.layout_bytes, m.bucket_bytes, m.alignment)
        if st.validated is not None and st.validated[0]() is self.model and st.validated[1] == layout:
            return m, []
        params, aliases = model_params(self.model)
        devices = {p.device for p in params.values()}
        if len(devices) > 1:
            return m, [f"the engine's parameters live on several devices {sorted(map(str, devices))}"]
        problems = validate_manifest(m, param_infos(params), aliases)
        if not problems:
            st.validated = (weakref.ref(self.model), layout)
        return m, problems

    def _ws_staging(self, nbytes: int) -> torch.Tensor:
        st = self._ws()
        spare, st.spare = st.spare, None
        if spare is not None and spare.numel() >= nbytes and spare.device == normalize_device(self.device):
            return spare[:nbytes]
        del spare
        return alloc(nbytes, self.device)

    def _ws_release(self, staging: torch.Tensor | None) -> None:
        """A staging buffer that was not committed: kept for the next push, or freed."""
        st = self._ws()
        if staging is not None and st.keep_staging and st.spare is None:
            st.spare = whole(staging)

    @staticmethod
    def _ws_mark_ready(g: WeightSyncGroup, push_id: str) -> None:
        try:
            g.mark_ready(push_id)
        except Exception as e:  # the trainer then times out of its wait, and this rank out of the vote
            log.warning("could not mark this worker ready for push %s: %s", push_id, e)

    @staticmethod
    def _ws_retire(g: WeightSyncGroup, inflight: deque) -> int:
        work, k, nbytes = inflight.popleft()
        g.wait(work, f"receiving bucket {k}")
        return nbytes

    def _ws_plan_commit(self, m: Manifest, staging: torch.Tensor) -> dict:
        """Everything the commit needs, computed while the bytes are still arriving: the target
        parameter and staging view of every tensor, and whether the views can become the weights."""
        if m.adapter is not None:
            return self._ws_plan_adapter(m, staging)
        st = self._ws()
        params, aliases = model_params(self.model)
        targets = [params[t.name] if t.name in params else params[aliases[t.name]] for t in m.tensors]
        views = [staging[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape) for t in m.tensors]
        swap = st.commit == "swap" and all(p.dtype == v.dtype for p, v in zip(targets, views))
        return {"targets": targets, "views": views, "swap": swap}

    def _ws_commit(self, m: Manifest, staging: torch.Tensor, plan: dict | None = None) -> None:
        """Point (or copy) every parameter at its staged value. Cannot fail half way: shapes,
        dtypes and names were validated, and assignment / same-size copies do not raise."""
        st = self._ws()
        plan = plan or self._ws_plan_commit(m, staging)
        targets, views, swap = plan["targets"], plan["views"], plan["swap"]
        old_storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in targets} if swap else {}
        with torch.no_grad():
            if swap:
                for p, view in zip(targets, views):
                    p.data = view
            else:
                for p, view in zip(targets, views):
                    p.copy_(view)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # staging may come from the receiving thread's stream: the forward reads it on this
            # one now, so the allocator must not hand it out again before this stream is past it
            staging.record_stream(torch.cuda.current_stream(self.device))
        if m.adapter is not None:
            self._ws_adapter_committed(m, staging, plan)
            if not m.adapter.with_base:
                return
        else:
            st.base_id, st.w0, st.lora_spare = None, None, None  # the weights are what this push said: no known base
            if getattr(self, "lora_bank", None) is not None:
                self.lora_bank.clear()
        previous, st.current = st.current, None
        if swap:
            st.current = (staging.untyped_storage().data_ptr(), staging.untyped_storage().nbytes())
        if not st.keep_staging:
            return
        if not swap:
            st.spare = whole(staging)  # copied out: the staging buffer is free again
        elif len(old_storages) == 1:
            # Reuse the previous weights' storage only if it is the staging buffer of our previous
            # swap (never, say, a checkpoint's memory-mapped file).
            (old,) = old_storages.values()
            if previous == (old.data_ptr(), old.nbytes()) and old.nbytes() > 0:
                st.spare = whole(old, self.device)
        # else: the checkpoint's weights (one storage each) are freed as they are

