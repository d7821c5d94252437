"""Trainer side: `WeightSender` streams a model's weights to every engine worker in one broadcast
per bucket, over a weight-sync group the trainer heads (rank 0).

What it accepts: an `nn.Module` (wrapped or not) or an iterable of `(name, tensor)`; which tensors
that means, under which names, is `weight_sync.trainer.weights`.

- Sharded parameters are gathered one at a time (DTensor `full_tensor()`) right before their
  bucket is packed, FSDP1 modules are read inside `summon_full_params` (FSDP1 materialises every
  full parameter at once: that is its design, not ours). Gathers are collectives of the
  trainer's own group: every trainer rank must take part, the non-zero ranks through
  `WeightSender.gather_only(weights)`.
- Memory: no second copy of the model. A bucket made of one contiguous tensor already in the
  wire dtype and on the group's device is broadcast straight from the tensor (zero copy); other
  buckets are packed into one of two bucket buffers, packing bucket k+1 while bucket k is on the
  wire (double buffering with async work handles).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from weight_sync.common.checksum import weights_checksum
from weight_sync.common.devices import normalize_device
from weight_sync.common.group import GroupError, WeightSyncGroup
from weight_sync.common.lora import A_SUFFIX, B_SUFFIX
from weight_sync.common.manifest import DEFAULT_BUCKET_BYTES, DeltaSpec, Manifest, build_manifest, dtype_name
from weight_sync.common.phases import Phases
from weight_sync.common.votes import (
    VOTE_OK, VOTE_STALE, VOTE_UNREADABLE, WeightSyncError, WeightSyncRefusedError, commit_vote, manifest_vote,
    mismatch_error,
)
from weight_sync.trainer.bucket_sender import BucketSender
from weight_sync.trainer.delta_encode import EncodedDelta, KeptWeights, advance, encode_delta, keeps_base, kept_weights
from weight_sync.trainer.device_stream import DeviceStream
from weight_sync.trainer.lora_push import AdapterPush, push_source
from weight_sync.trainer.progress_marks import ProgressMarks
from weight_sync.trainer.ranks import DONE, GATHER, has_peers, tell_peers
from weight_sync.trainer.reused_layout import layout_for, versioned
from weight_sync.trainer.vote_outcome import vote_refusal
from weight_sync.trainer.weights import full, gather_context, list_weights, named_weights

log = logging.getLogger(__name__)


@dataclass
class PreparedPush:
    manifest: Manifest
    weights: object  # the source, enumerated again (under its gather context) when `named` is None
    # The (name, tensor) pairs prepare() enumerated, kept when reading them needs no context
    # (everything but FSDP1): send() then does not walk the model a second time.
    named: list | None = None
    # (vote, problem) found by walk() when it listed the weights ahead of send()
    verdict: tuple[int, str] | None = None
    # the sender's slot that keeps this push's layout for later pushes: send() empties it when the
    # push is refused (a refused layout is never started on again: the next push would meet the
    # same refusal first)
    layout_slot: str = "_last_layout"
    delta: EncodedDelta | None = None  # a delta push (weight_sync/common/delta_push.py): what it encodes


class WeightSender:
    """Rank 0 of the weight-sync group.

    ```python
    sender = WeightSender()                                  # bucket size from the benchmark
    info = sender.open_group(world_size=1 + n_workers)       # store up; info goes to the workers
    # concurrently: sender.join_group() (blocking) and each worker's init_weight_sync(**info, rank=...)
    prepared = sender.prepare(model, version=k)              # manifest -> workers' receive_weights
    sender.send(prepared)                                    # concurrently with the workers
    ```
    `weight_sync.trainer.local_engines` runs these steps against AsyncEngines.
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, timeout_s: float = 120.0, max_inflight: int = 4,
                 keep_sent: bool | None = False):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype (floating weights are cast to it), got {dtype}")
        self.bucket_bytes = int(bucket_bytes)
        self.device = normalize_device(device) if device is not None else None
        self.dtype = dtype
        self.timeout_s = float(timeout_s)
        self.max_inflight = max(1, int(max_inflight))
        self.group: WeightSyncGroup | None = None
        self._buckets = BucketSender(self.bucket_bytes, self.max_inflight)
        self._device = DeviceStream()  # CUDA: the stream a push packs and sends on
        self._last_layout: tuple | None = None  # ((specs, bucket_bytes), manifest) of the last push not refused
        self._last_adapter: tuple | None = None  # the same, for adapter pushes (weight_sync.trainer.lora_push)
        # What the last committed push sent, kept as the next delta's base (weight_sync/common/delta_push.py):
        # True keeps it, False never, None when the push travels in 2-byte floats (where deltas pay)
        self.keep_sent = keep_sent
        self.kept: KeptWeights | None = None

    # -- group ------------------------------------------------------------------------------
    def open_group(self, world_size: int, host: str = "127.0.0.1", port: int = 0, timeout_s: float | None = None,
                   group_name: str | None = None, device: torch.device | str | None = None) -> dict:
        """Start a fresh group generation (closing any previous one): create the store, return
        what workers need to join ({host, port, world_size, group_name, timeout_s}). Then call
        `join_group()` while the workers join."""
        self.close_group()
        dev = normalize_device(device) if device is not None else (self.device or torch.device("cpu"))
        self.group = WeightSyncGroup.master(host=host, port=port, world_size=world_size,
                                            timeout_s=timeout_s or self.timeout_s, device=dev, group_name=group_name)
        return self.group.connection_info()

    def join_group(self) -> None:
        """Blocks until every worker joined (or the group's timeout). Closes the group on failure."""
        if self.group is None:
            raise GroupError("open_group() first")
        try:
            self.group.join()
        except Exception:
            self.close_group()
            raise

    def call_off_group(self) -> None:
        """A worker will not join the group that is forming (its host went): every rank's join,
        this trainer's `join_group()` too, ends now with GroupError instead of at the timeout."""
        if self.group is not None and not self.group.ready:
            try:
                self.group.call_off_forming()
            except Exception as e:  # noqa: BLE001 - the joins then end at the group's timeout
                log.warning("could not call the forming of group %s off: %s", self.group.group_name, e)

    def close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._buckets.reset()

    # -- pushes -----------------------------------------------------------------------------
    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as a push sends it (cast to the wire dtype): what the engine holds after."""
        return t.to(self._wire_dtype(t))

    def _wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.dtype.is_floating_point else t.dtype

    def prepare(self, weights, version: int, reuse_layout: bool = False) -> PreparedPush:
        """The manifest of a push (names, dtypes, shapes, layout and buckets); gathers nothing.

        A one-shot iterable is listed once here (references, no copies) so it can be sent later.
        `reuse_layout=True`: when an earlier push (not refused) had a layout at this bucket size, take it
        without walking the weights now; `send()` walks them (while the manifest travels to the workers)
        and, if they no longer fit it, refuses the push before any byte moves
        (StaleManifestError): prepare again without reuse and push again.
        A PEFT model is pushed as its adapter (weight_sync.trainer.lora_push; `push_source(model, "merged")`
        for its merged weights).
        """
        weights = push_source(weights)
        if isinstance(weights, AdapterPush):  # a LoRA adapter (weight_sync.trainer.lora_push): listed now, it is small
            named, spec = weights.listing()
            # the factors go in their own dtype: the engine merges them as PEFT does (an fp32
            # adapter's delta rounded once into a bf16 base); cast first, the sum would differ
            factors = {n for n, _ in named if n.endswith((A_SUFFIX, B_SUFFIX))}
            manifest = self._manifest(self._specs(named, keep=factors), version, "_last_adapter")
            return PreparedPush(msgspec.structs.replace(manifest, adapter=spec), weights, named,
                                layout_slot="_last_adapter")
        if not isinstance(weights, (torch.nn.Module, dict, list, tuple)):
            weights = list(weights)
        if has_peers() and gather_context(weights) is not None:
            raise ValueError("FSDP1 (FullyShardedDataParallel) with several trainer ranks: its summon_full_params "
                             "would have every rank follow each step of the push; shard with FSDP2 (fully_shard), "
                             "whose parameters are gathered tensor by tensor")
        last = self._last_layout
        if reuse_layout and last is not None and last[0][1] == self.bucket_bytes:
            return PreparedPush(versioned(last[1], version), weights, None)
        ctx = gather_context(weights)
        with ctx or contextlib.nullcontext(), torch.no_grad():
            named = list_weights(weights)
            specs = self._specs(named)
        return PreparedPush(self._manifest(specs, version), weights, named if ctx is None else None)

    def prepare_delta(self, weights, version: int) -> PreparedPush | None:
        """A delta push of `weights` against what the last committed push sent (weight_sync/common/delta_push.py),
        or None when there is none to make: nothing kept, the weights changed names, dtypes or
        shapes, an adapter, or a trainer of several ranks (its gathers follow a full push's order).
        Reads every weight now (a delta is made of values); the manifest's `delta` names its base."""
        kept = self.kept
        weights = push_source(weights)
        if kept is None or has_peers() or isinstance(weights, AdapterPush) or gather_context(weights) is not None:
            return None
        if not isinstance(weights, (torch.nn.Module, dict, list, tuple)):
            weights = list(weights)
        named = list_weights(weights)
        specs = self._specs(named)
        if specs != kept.specs:
            return None
        enc = encode_delta(((n, full(t)) for n, t in named), self._on_wire, kept)
        whole = self._manifest(specs, version)
        payload = build_manifest(self._specs(enc.pairs), version, self.bucket_bytes)
        spec = DeltaSpec(kept.version, kept.digest, enc.digest, whole.tensors, whole.layout_bytes, enc.parts)
        return PreparedPush(msgspec.structs.replace(payload, delta=spec), weights, enc.pairs, delta=enc)

    def _after_commit_vote(self, prepared: PreparedPush, named, digest: int) -> None:
        """Every rank holds the push's bytes: what it sent becomes the next delta's base."""
        m = prepared.manifest
        if prepared.delta is not None:
            advance(self.kept, prepared.delta, m.version)
            return
        previous, self.kept = self.kept, None  # an adapter merged, or weights this sender does not keep: no base
        specs = [(t.name, t.dtype, tuple(t.shape)) for t in m.tensors]
        if m.adapter is not None or has_peers() or gather_context(prepared.weights) is not None or \
                not keeps_base(self.keep_sent, specs):
            return
        self.kept = kept_weights(m.version, digest, specs, named, self._wire_dtype, previous)

    def walk(self, prepared: PreparedPush) -> None:
        """List the weights of a push prepared with `reuse_layout=True` now, on this thread, and
        check them against its manifest, instead of in send(): for a caller with a wait to hide
        it in (local_engines.push_to_engines walks while the workers check the manifest). Does
        nothing when the push holds its list already or needs a gather context (FSDP1)."""
        if prepared.named is not None or prepared.verdict is not None or gather_context(prepared.weights):
            return
        try:
            named = list_weights(prepared.weights)
            prepared.verdict = self._check(named, prepared.manifest)
        except Exception as e:  # send() votes the refusal: the workers may hold the manifest already
            prepared.verdict = (VOTE_UNREADABLE, f"the weights cannot be read: {type(e).__name__}: {e}")
            return
        prepared.named = named

    def _specs(self, named: list, keep: set[str] = frozenset()) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, wire dtype, shape) of each listed tensor: what a manifest says of it. Those
        named in `keep` go in their own dtype."""
        return [(n, dtype_name(t.dtype if n in keep else self._wire_dtype(t)), tuple(t.shape)) for n, t in named]

    def _check(self, named: list, m: Manifest) -> tuple[int, str]:
        """Whether listed weights still fit the manifest (a reused layout may not)."""
        if self._specs(named) != [(t.name, t.dtype, tuple(t.shape)) for t in m.tensors]:
            return VOTE_STALE, "the weights changed names, dtypes or shapes since prepare()"
        return VOTE_OK, ""

    def _manifest(self, specs: list, version: int, slot: str = "_last_layout") -> Manifest:
        """The push's manifest, on the previous push's layout when it still fits (reused_layout.py).
        `slot`: the attribute that keeps it (adapter pushes keep theirs apart, so a full push's
        reused layout stays)."""
        manifest, last = layout_for(getattr(self, slot), specs, self.bucket_bytes, version)
        setattr(self, slot, last)
        return manifest

    def _forget_layout(self, slot: str, m: Manifest) -> None:
        """A refused push's layout is not started on again: the next push walks its weights afresh."""
        last = getattr(self, slot)
        if last is not None and last[1].tensors is m.tensors:
            setattr(self, slot, None)

    def checksum(self, weights) -> str:
        """The checksum the engine's `weights_checksum()` reports after this push (in the wire dtype).
        A trainer of several ranks: the others call `follow_push(weights)` meanwhile."""
        weights = push_source(weights, "merged")  # a PEFT model: the engine merges what it is sent
        tell_peers(GATHER)
        try:
            with named_weights(weights) as named:
                return weights_checksum((n, self._on_wire(full(t))) for n, t in named)
        finally:
            tell_peers(DONE)

    def push(self, weights, version: int, progress: Callable[[int, int], None] | None = None) -> dict:
        """prepare + send: only for when the workers already hold the manifest's twin (tests,
        benchmarks); normally the manifest must reach the workers first, see weight_sync.trainer.local_engines."""
        return self.send(self.prepare(weights, version), progress)

    def send(self, prepared: PreparedPush, progress: Callable[[int, int], None] | None = None,
             before_vote: Callable[[], None] | None = None) -> dict:
        """The trainer's side of a push (the workers run `receive_weights(manifest)` meanwhile): 1. the
        manifest vote; 2. one broadcast per bucket, double buffered; 3. the commit vote (every rank
        has every byte; a single worker's own receive tells it), then the workers commit.
        Raises WeightSyncError (a WeightSyncRefusedError when nothing moved). `progress(bucket,
        n_buckets)` is called after each bucket is handed to the transport. `before_vote()`, if
        given, runs right before the vote: it may block (until the workers are ready) or raise to
        call the push off; the trainer then never votes, so no worker may be voting either."""
        g = self.group
        if g is None or not g.ready:
            raise WeightSyncError("no weight-sync group: open_group() + join_group() first")
        m = prepared.manifest
        t0 = time.perf_counter()
        phases = Phases()
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._device.on(g.device))
            named, status, problem = self._listed(prepared, stack)
            phases.mark("list")
            _call_before_vote(before_vote, m)
            phases.mark("gate")  # until every worker is ready for the vote
            marks = ProgressMarks(g, m.push_id)
            if status == VOTE_STALE:
                marks.withdrawn()  # before the vote: a sidecar that sees it refused reads why
            try:
                self._vote(status, m, problem)
            except WeightSyncError as e:
                if e.refused:
                    self._forget_layout(prepared.layout_slot, m)
                raise
            phases.mark("vote")
            meant = self._transfer(g, m, named, progress, marks, phases)
            self._after_commit_vote(prepared, named, meant)
            phases.mark("keep")  # the next delta's base
        return _sent(prepared, time.perf_counter() - t0, phases.seconds)

    def _listed(self, prepared: PreparedPush, stack: contextlib.ExitStack) -> tuple[list | None, int, str]:
        """The push's (name, tensor) pairs, listed now unless prepare() or walk() did (a reused
        layout; a gather context, entered on `stack`), and the status the trainer votes: whether
        they fit the manifest."""
        named = prepared.named
        status, problem = prepared.verdict or (VOTE_OK, "")
        try:
            if named is None and status == VOTE_OK:
                named = stack.enter_context(named_weights(prepared.weights))
                status, problem = self._check(named, prepared.manifest)
        except Exception as e:  # the workers may hold the manifest already: they must hear the refusal
            status, problem = VOTE_UNREADABLE, f"the weights cannot be read: {type(e).__name__}: {e}"
        return named, status, problem

    def _transfer(self, g: WeightSyncGroup, m: Manifest, named: list, progress, marks: ProgressMarks,
                  phases: Phases) -> int:
        """Steps 2 and 3: the buckets, then the commit vote on the digest of what the trainer meant
        to send (returned). A failure marks the push failed and closes the group: WeightSyncError."""
        marks.start()
        try:
            self._buckets.send(g, m, [t for _, t in named], progress, marks, phases)
            phases.mark("buckets")
            meant = self._buckets.digest.value() if m.delta is None else m.delta.digest
            with marks.on_wire():  # the workers hash their last bucket meanwhile
                bad = commit_vote(g, meant)
            phases.mark("commit_vote")
            if bad:
                raise GroupError(mismatch_error(m.version, bad))
            marks.done()
        except Exception as e:
            marks.failed()
            self.close_group()
            raise WeightSyncError(f"push of version {m.version} failed: {e}; the group is closed, "
                                  "form a new one (open_group / init_weight_sync)") from e
        return meant

    def gather_only(self, weights) -> None:
        """On trainer ranks other than the sender: take part in the gathers (DTensor
        `full_tensor()`, FSDP1 summon) in the sender's order, send nothing."""
        with named_weights(weights) as named:
            for _, t in named:
                if hasattr(t, "full_tensor"):
                    t.full_tensor()

    # -- internals --------------------------------------------------------------------------
    def _vote(self, status: int, m: Manifest, problem: str) -> None:
        """Step 1: the manifest vote; raises unless every rank took the same manifest."""
        try:
            verdict = manifest_vote(self.group, status, m.digest())
            self.group.vote_passed(m.push_id)
        except GroupError as e:
            self.close_group()
            raise WeightSyncError(f"push of version {m.version}: the manifest vote failed ({e}); the group is "
                                  "closed") from e
        refused = vote_refusal(status, m, problem, verdict)
        if refused is not None:
            raise refused

def _sent(prepared: PreparedPush, seconds: float, phases: dict) -> dict:
    """A push's trainer result: its bytes on the wire beside the full weights' (a delta's are fewer),
    and where its seconds went (`phases`: weight_sync/common/phases.py)."""
    m = prepared.manifest
    log.info("pushed %s%s in %.3fs (%.2f GB/s)", "a delta: " if m.delta else "", m.summary(), seconds,
             m.total_bytes / seconds / 1e9)
    full_bytes = m.total_bytes if m.delta is None else prepared.delta.full_bytes
    out = {"version": m.version, "bytes": m.total_bytes, "full_bytes": full_bytes, "delta": m.delta is not None,
           "seconds": seconds, "buckets": len(m.buckets), "phases": phases}
    if prepared.delta is not None:
        out["encode_seconds"] = prepared.delta.seconds  # before the send, in prepare_delta
    return out


def _call_before_vote(before_vote: Callable[[], None] | None, m: Manifest) -> None:
    """The caller's hook right before the vote: it may block (until the workers are ready) or
    raise to call the push off (WeightSyncError, refused: nothing moved)."""
    if before_vote is None:
        return
    try:
        before_vote()
    except WeightSyncError:
        raise
    except Exception as e:
        raise WeightSyncRefusedError(f"push of version {m.version} called off before the vote: {e}") from e
