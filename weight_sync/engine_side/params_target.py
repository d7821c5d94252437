"""`ParamsTarget`: a push into a HF model's own parameters (our engine's worker), the target of
weight_sync/engine_side/targets.py that swaps pointers instead of copying."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

import torch

from weight_sync.common.manifest import (
    DEFAULT_BUCKET_BYTES, Manifest, build_manifest, dtype_name, model_params, param_infos, validate_manifest,
)
from weight_sync.engine_side.lora_target import LoraMergeTarget
from weight_sync.engine_side.staging_memory import StagingPool, whole
from weight_sync.engine_side.targets import CommitPlan, Pairs, sync_device, views

log = logging.getLogger(__name__)

COMMIT_MODES = ("swap", "copy")


class ParamsTarget:
    """A HF model's own parameters (our engine's worker: `host.model`, `.device`, `.lora_bank`,
    `.weights_released`, read at each call since a reload replaces the model). The commit points
    each parameter at its slice of the staging buffer (`param.data = view`, no copy; the old
    storage is released) or, when a dtype cast is needed or `commit_mode="copy"`, copies into it."""

    def __init__(self, host, pool: StagingPool, commit_mode: str = "swap"):
        self.host = host
        self.pool = pool
        self.commit_mode = commit_mode
        self.adapter = LoraMergeTarget(host, pool)
        # (weakref to the model, layout) of the last manifest that passed: the next push of a run has
        # the same layout and skips the walk over the model (a reload makes a new model object)
        self.validated: tuple | None = None
        self.current: tuple[int, int] | None = None  # (data_ptr, nbytes) of the staging buffer the weights live in
        # (manifest, buffer) of the full push whose buffer the weights were swapped into, laid out by it
        self.served_push: tuple[Manifest, torch.Tensor] | None = None

    def check(self, m: Manifest) -> list[str]:
        if getattr(self.host, "weights_released", False):
            return ["the engine's weights are released (sleep level 2): wake_up() first"]
        if m.adapter is not None:
            return self.adapter.check(m)
        model = self.host.model
        layout = (m.tensors, m.buckets, m.total_bytes, m.layout_bytes, m.bucket_bytes, m.alignment)
        if self.validated is not None and self.validated[0]() is model and self.validated[1] == layout:
            return []
        params, aliases = model_params(model)
        devices = {p.device for p in params.values()}
        if len(devices) > 1:
            return [f"the engine's parameters live on several devices {sorted(map(str, devices))}"]
        problems = validate_manifest(m, param_infos(params), aliases)
        if not problems:
            self.validated = (weakref.ref(model), layout)
        return problems

    def plan_needs_bytes(self, m: Manifest) -> bool:
        return m.adapter is not None

    def plan(self, m: Manifest, staging: torch.Tensor) -> CommitPlan:
        if m.adapter is not None:
            return self.adapter.plan(m, staging)
        params, aliases = model_params(self.host.model)
        pairs = views(m, staging, lambda name: name if name in params else aliases[name])
        targets = [params[name] for name, _ in pairs]
        # NOTE: a part of an update is copied in: swapped, the weights would live in several staging
        # buffers, and a commit would hand back as free a buffer that other weights still live in
        swap = (self.commit_mode == "swap" and not m.partial
                and all(p.dtype == v.dtype for p, (_, v) in zip(targets, pairs)))
        return CommitPlan(staging, pairs, targets, swap)

    def derive(self, m: Manifest, plan: CommitPlan, changed: set[int] | None = None) -> None:
        """The worker's derived copies (`stage_derived_copies`: the prepacked linears) made from the
        staged pairs now, on the receiving thread. A failure here costs no push: the commit then
        drops the copies and the next forward derives them, as before."""
        stage = getattr(self.host, "stage_derived_copies", None)
        if stage is None or not plan.params or m.partial:  # a part's: derived again at the first forward
            return
        unchanged = None
        if changed is not None and m.adapter is None:  # the pairs follow m.tensors (views)
            unchanged = {id(p) for k, p in enumerate(plan.params) if k not in changed}
        try:
            plan.derived = stage(list(zip(plan.params, (t for _, t in plan.pairs))), unchanged)
        except Exception as e:  # noqa: BLE001 - the weights still commit; their copies follow lazily
            log.warning("deriving the served copies of version %d from its staged weights failed (%s: %s): the "
                        "first forward after its commit derives them", m.version, type(e).__name__, e)

    def commit(self, m: Manifest, plan: CommitPlan) -> torch.Tensor | None:
        """Cannot fail half way: names, shapes and dtypes were validated, and assignment or
        same-size copies do not raise."""
        replaced = assign(plan, self.host.device)
        # served from now on; the plan (kept by the push's record) must not hold them past the next push
        derived, plan.derived = plan.derived, None
        self._written(derived)
        if m.adapter is not None:
            self.served_push = None  # merged into new tensors
            self.adapter.committed(m, plan)
            if not m.adapter.with_base:
                return plan.staging  # the factors are merged: the buffer is free for the next push
        else:
            self._new_weights()
        previous, self.current = self.current, None
        if not plan.swap:
            return plan.staging  # copied out: free again (the weights stay where they were)
        storage = plan.staging.untyped_storage()
        self.current = (storage.data_ptr(), storage.nbytes())
        self.served_push = (m, whole(plan.staging)) if m.adapter is None and not m.partial else None
        if len(replaced) == 1:
            # the previous weights' storage is free memory only if it was our previous staging
            # buffer (never, say, a checkpoint's memory-mapped file)
            (old,) = replaced.values()
            if previous == (old.data_ptr(), old.nbytes()) and old.nbytes() > 0:
                return whole(old, self.host.device)
        return None  # a checkpoint's weights (one storage each) are freed as they are

    def commit_stream(self, m: Manifest, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        params, aliases = model_params(self.host.model)
        with torch.no_grad():
            for name, t in pairs:
                params[name if name in params else aliases[name]].copy_(t)
        sync_device(self.host.device)
        self._written()
        self.current = None
        self._new_weights()

    def served(self) -> Pairs:
        """With unmerged LoRA (engine/lora_bank.py), the weights with the newest adapter merged:
        what a merged engine holds, so one check fits both."""
        bank = getattr(self.host, "lora_bank", None)
        named = self.host.model.named_parameters()
        if bank is None or not bank.active:
            return named
        return [(n, bank.merged(n.removesuffix(".weight"), p)) for n, p in named]

    def own_layout(self) -> Manifest | None:
        """A full push of these weights in their own dtypes: the layout the pushes that keep them
        take (None: no parameters)."""
        params, _ = model_params(self.host.model)
        specs = [(n, dtype_name(p.dtype), tuple(p.shape)) for n, p in params.items()]
        return build_manifest(specs, 0, DEFAULT_BUCKET_BYTES) if specs else None

    def adopt(self) -> int:
        """Move the weights into one buffer of the pool laid out as a full push of them, as a swap
        commit would have put them: the first push's commit then frees a whole buffer, kept for
        the next push, instead of the checkpoint's tensors one by one (a new buffer in their place
        would fault its pages in again, seconds a gigabyte while the engine serves). Same values,
        same dtypes; the derived copies follow at the next forward. Returns the buffer's bytes (0:
        left as they are: a copy commit keeps the weights where they are)."""
        m = self.own_layout()
        if m is None or self.commit_mode != "swap" or self.host.device.type != "cpu" or self.current is not None:
            return 0
        params, _ = model_params(self.host.model)
        buf = self.pool.fresh(m.layout_bytes)
        plan = CommitPlan(buf, views(m, buf), [params[t.name] for t in m.tensors], swap=True)
        with torch.no_grad():
            for p, (_, view) in zip(plan.params, plan.pairs):
                view.copy_(p)
        assign(plan, self.host.device)
        self._written()
        storage = buf.untyped_storage()
        self.current = (storage.data_ptr(), storage.nbytes())
        self.served_push = (m, buf)
        return m.layout_bytes

    def served_whole(self) -> tuple[Manifest, torch.Tensor] | None:
        """(manifest, buffer) when every weight lives in that buffer as that full push laid it out
        (its bytes then are the served weights, in a push's layout: a host copy can link them);
        None when some weight lives elsewhere (an adapter merged into new tensors, a checkpoint's)."""
        if self.served_push is None:
            return None
        m, buf = self.served_push
        params, aliases = model_params(self.host.model)
        base = buf.data_ptr()
        for t in m.tensors:
            p = params[t.name] if t.name in params else params.get(aliases.get(t.name, ""))
            if p is None or p.data_ptr() != base + t.offset or dtype_name(p.dtype) != t.dtype:
                return None
        return self.served_push

    def base(self, m: Manifest) -> list[torch.Tensor]:
        params, aliases = model_params(self.host.model)
        return [params[t.name if t.name in params else aliases[t.name]].detach() for t in m.tensors]

    def forget(self) -> None:
        self.current = self.served_push = None
        self.adapter.forget()

    def spare_memory(self) -> list[torch.Tensor]:
        """The buffers kept for the next adapter push's merges (none without one)."""
        return list((self.adapter.spare or {}).values())

    def _written(self, derived=None) -> None:
        """Tell the worker its weights changed: it serves the copies `derived` from the staged
        pairs, and drops those of weights written without (their own check misses a swap back
        onto memory a weight held two pushes ago)."""
        written = getattr(self.host, "weights_written", None)
        if written is None:
            return
        if derived is None:
            written()
        else:  # a pool that keeps its staging keeps the replaced copies too: the next push's memory
            written(derived, keep_replaced=self.pool.keep)

    def _new_weights(self) -> None:
        """A full push: the weights are what it said, of no known LoRA base."""
        self.adapter.forget()
        if getattr(self.host, "lora_bank", None) is not None:
            self.host.lora_bank.clear()


def assign(plan: CommitPlan, device: torch.device) -> dict:
    """Point (or copy) every planned parameter at its tensor; returns the storages a swap
    replaced (data_ptr -> storage)."""
    replaced = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in plan.params} if plan.swap else {}
    with torch.no_grad():
        for p, (_, t) in zip(plan.params, plan.pairs):
            if plan.swap:
                p.data = t
            else:
                p.copy_(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # staging may come from the receiving thread's stream: the forward reads it on this one
        # now, so the allocator must not hand it out again before this stream is past it
        plan.staging.record_stream(torch.cuda.current_stream(device))
    return replaced
