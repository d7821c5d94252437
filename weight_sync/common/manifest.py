"""The manifest of one push and the pure functions around it: bucket planning, dtype policy and
validation against a model. No I/O here, so all of it is unit-tested without processes.

Layout: the pushed tensors are laid out, in manifest order, in one flat byte space; every tensor
starts at a multiple of `alignment` bytes. A bucket is a contiguous byte range of that space
covering consecutive tensors, at most `bucket_bytes` long unless one tensor alone is bigger (then
that tensor is its own bucket). Each bucket is one broadcast. The receiver's staging buffer has
exactly this layout, so a bucket lands in place and committing needs no unpacking.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

ALIGNMENT = 256  # bytes; what cudaMalloc guarantees, more than any dtype or vector load needs
# Chosen with bench/weight_sync.py (see bench/RESULTS.md): on CPU/gloo every size from 16 MiB up
# reaches the transport's rate; smaller buckets pay per-collective overhead, larger ones grow the
# trainer's two packing buffers for nothing. The DESIGN's "hundreds of MB" suits NCCL links.
DEFAULT_BUCKET_BYTES = 64 * 2**20
# A tensor this large is a bucket of its own (plan_layout): sent with no copy from a trainer's
# tensor; below it, the broadcasts' fixed cost outweighs the copy that packing costs.
ALONE_BYTES = 4 * 2**20

# The dtypes a push carries, by name, with their bytes per element. Written out rather than asked
# of torch: the sidecar's front end reads manifests and imports no torch (`DTYPES`, the torch
# dtype of each name, is made on first use).
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})


def __getattr__(name: str):
    if name == "DTYPES":
        import torch

        value = {n: getattr(torch, n) for n in _ITEMSIZE}
        globals()["DTYPES"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise ValueError(f"dtype {dtype} cannot be pushed (supported: {sorted(_ITEMSIZE)})")
    return name


def itemsize(name: str) -> int:
    return _ITEMSIZE[name]


def can_take(wire: str, param: str) -> bool:
    """Dtype policy: a parameter takes the same dtype, or any floating dtype when it is floating
    itself (the cast `param.copy_()` does: round to nearest, as `from_pretrained(dtype=...)` does
    when a checkpoint's dtype differs). Integer / bool parameters take only their own dtype, and
    a floating value never goes into an integer parameter or the reverse."""
    return wire == param or (wire in FLOAT_DTYPES and param in FLOAT_DTYPES)


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the flat layout
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Bucket(msgspec.Struct, array_like=True, frozen=True):
    start: int  # byte range [start, end) of the flat layout: one broadcast
    end: int
    first: int  # tensors [first, last) of the manifest
    last: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class AdapterSpec(msgspec.Struct, frozen=True):
    """An adapter push (weight_sync.common.lora): its tensors are LoRA factors to merge into a base."""

    base_id: str  # the base the adapter applies to: a checksum of the trainer's base weights
    scales: dict[str, float]  # target module (HF name) -> scaling (lora_alpha / r, or / sqrt(r) with rsLoRA)
    with_base: bool = False  # the manifest carries the base's weights too (the engine keeps them as W0)


class DeltaPart(msgspec.Struct, array_like=True, frozen=True):
    """One changed tensor of a delta push (weight_sync/common/delta_push.py)."""

    tensor: int  # its index in DeltaSpec.full
    kind: str  # how its positions go: "indices", "bitmap" or "full" (weight_sync/common/delta.py)
    count: int  # values sent: its changed elements (every element for "full")


class DeltaSpec(msgspec.Struct, frozen=True):
    """A delta push: the manifest's tensors carry only what changed since the weights the
    receiver must hold (`base_version`, whose content digest is `base_digest`); applied, they
    make the weights `full` lays out, whose digest is `digest` (weight_sync/common/digest.py)."""

    base_version: int
    base_digest: int
    digest: int
    full: list[TensorSpec]  # the weights a full push of this version would carry, laid out as it would
    full_bytes: int  # that layout's size
    parts: list[DeltaPart]  # the tensors that changed, in `full`'s order; the others stay as they are


class Manifest(msgspec.Struct, frozen=True):
    version: int
    tensors: list[TensorSpec]
    buckets: list[Bucket]
    total_bytes: int  # payload: sum of the tensors' bytes
    layout_bytes: int  # size of the flat layout, alignment padding included
    bucket_bytes: int
    alignment: int = ALIGNMENT
    push_id: str = ""
    adapter: AdapterSpec | None = None  # set for a LoRA adapter push
    delta: DeltaSpec | None = None  # set for a delta push (weight_sync/common/delta_push.py)
    # a part of an update that spans several pushes (SGLang's update_weights_from_distributed, one
    # call per bucket): it need not cover every parameter (rollout/sidecar/sglang_transfer.py commits the parts)
    partial: bool = False

    # -- wire -------------------------------------------------------------------------------
    def to_wire(self) -> dict:
        """Builtins only (dict / list / str / int), for msgpack over collective_rpc."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_wire(cls, obj) -> "Manifest":
        if isinstance(obj, Manifest):
            return obj
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return msgspec.msgpack.decode(obj, type=cls)
        if isinstance(obj, str):
            return msgspec.json.decode(obj, type=cls)
        return msgspec.convert(obj, cls)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    def digest(self) -> int:
        """A 62-bit fingerprint of the whole manifest; ranks compare it before any byte moves."""
        h = hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=8).digest()
        return int.from_bytes(h, "little") & ((1 << 62) - 1)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def summary(self) -> str:
        return (f"version {self.version}: {len(self.tensors)} tensors, {self.total_bytes / 1e6:.1f} MB in "
                f"{len(self.buckets)} buckets of <= {self.bucket_bytes / 2**20:g} MiB")


# -- planning --------------------------------------------------------------------------------
def plan_layout(nbytes: Sequence[int], bucket_bytes: int, alignment: int = ALIGNMENT
                ) -> tuple[list[int], int, list[Bucket]]:
    """Offsets of each tensor in the flat layout, the layout's size, and the buckets.

    Tensors keep their order. A bucket collects consecutive tensors while its byte range stays
    within `bucket_bytes`; a tensor larger than that gets a bucket of its own, and so does one of
    ALONE_BYTES or more: a trainer whose weights are not flattened sends it from its own memory, no
    copy (weight_sync/trainer/bucket_sender.py), where packing it with its neighbours cost a copy of
    the model a push (0.7 s of a 1.7B model's 2 s here). Empty tensors take no room and ride along
    in whichever bucket is open.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    offsets, pos = [], 0
    for n in nbytes:
        if n < 0:
            raise ValueError(f"negative byte count {n}")
        pos = -(-pos // alignment) * alignment
        offsets.append(pos)
        pos += n
    layout = pos
    buckets: list[Bucket] = []
    first, big = 0, bool(nbytes) and nbytes[0] >= ALONE_BYTES  # big: the open bucket holds one to keep alone
    for i in range(1, len(offsets)):
        start, end = offsets[first], offsets[i - 1] + nbytes[i - 1]  # tensor ends never decrease
        alone = big or nbytes[i] >= ALONE_BYTES
        if nbytes[i] and end > start and (alone or offsets[i] + nbytes[i] - start > bucket_bytes):
            buckets.append(Bucket(start, end, first, i))
            first, big = i, False
        big = big or nbytes[i] >= ALONE_BYTES
    if offsets:
        buckets.append(Bucket(offsets[first], offsets[-1] + nbytes[-1], first, len(offsets)))
    return offsets, layout, buckets


def build_manifest(specs: Iterable[tuple[str, str, Sequence[int]]], version: int, bucket_bytes: int,
                   alignment: int = ALIGNMENT) -> Manifest:
    """A manifest from (name, dtype name, shape) triples, in push order."""
    specs = [(n, d, tuple(int(s) for s in shape)) for n, d, shape in specs]
    for n, d, _ in specs:
        if d not in _ITEMSIZE:
            raise ValueError(f"{n}: dtype {d!r} cannot be pushed (supported: {sorted(_ITEMSIZE)})")
    sizes = [math.prod(shape) * itemsize(d) for _, d, shape in specs]
    offsets, layout, buckets = plan_layout(sizes, bucket_bytes, alignment)
    tensors = [TensorSpec(n, d, shape, off, size) for (n, d, shape), off, size in zip(specs, offsets, sizes)]
    return Manifest(version=int(version), tensors=tensors, buckets=buckets, total_bytes=sum(sizes),
                    layout_bytes=layout, bucket_bytes=int(bucket_bytes), alignment=alignment,
                    push_id=uuid.uuid4().hex)


# -- validation ------------------------------------------------------------------------------
def _listing(label: str, items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{label} ({len(items)}): {shown}{more}"


def check_layout(m: Manifest) -> list[str]:
    """Internal consistency: sizes match shapes, tensors inside the layout, aligned, in order, not
    overlapping, buckets tile the tensors. A manifest failing this never reaches the network."""
    problems: list[str] = []
    if m.alignment < 1 or m.alignment & (m.alignment - 1):
        return [f"alignment {m.alignment} is not a power of two"]
    if m.bucket_bytes < 1:
        problems.append(f"bucket_bytes {m.bucket_bytes} < 1")
    seen: set[str] = set()
    dup, prev_end, total = [], 0, 0
    for t in m.tensors:
        if t.name in seen:
            dup.append(t.name)
        seen.add(t.name)
        if t.dtype not in _ITEMSIZE:
            problems.append(f"{t.name}: unsupported dtype {t.dtype!r}")
            continue
        if any(s < 0 for s in t.shape):
            problems.append(f"{t.name}: negative dimension in shape {list(t.shape)}")
            continue
        if t.nbytes != t.numel * itemsize(t.dtype):
            problems.append(f"{t.name}: nbytes {t.nbytes} != {t.numel} x {itemsize(t.dtype)}")
        if t.offset % m.alignment or t.offset < prev_end:
            problems.append(f"{t.name}: offset {t.offset} misaligned or overlapping the previous tensor")
        prev_end = t.offset + t.nbytes
        total += t.nbytes
    if dup:
        problems.append(_listing("names given twice", dup))
    if prev_end != m.layout_bytes:
        problems.append(f"tensors end at byte {prev_end}, layout_bytes says {m.layout_bytes}")
    if total != m.total_bytes:
        problems.append(f"total_bytes {m.total_bytes} != sum of tensor sizes {total}")
    expect_first = 0
    for b in m.buckets:
        ok = b.first == expect_first and b.first < b.last <= len(m.tensors)
        if ok:
            span = m.tensors[b.first:b.last]
            ok = b.start == span[0].offset and b.end == max(t.offset + t.nbytes for t in span) and b.end >= b.start
        if not ok:
            problems.append(f"bucket {b} does not tile the tensors")
            break
        expect_first = b.last
    else:
        if expect_first != len(m.tensors):
            problems.append(f"buckets cover {expect_first} of {len(m.tensors)} tensors")
    return problems


class ParamInfo(msgspec.Struct, array_like=True, frozen=True):
    dtype: str
    shape: tuple[int, ...]


def validate_manifest(m: Manifest, params: Mapping[str, ParamInfo], aliases: Mapping[str, str] | None = None
                      ) -> list[str]:
    """Every problem that makes `m` unacceptable for a model whose parameters are `params`
    (canonical name -> dtype and shape); an empty list means the push can go ahead.

    Tied weights: `params` holds each parameter once, under its canonical name (the first name
    `named_parameters()` gives it; for HF models with tied embeddings that is
    `model.embed_tokens.weight`, and `lm_head.weight` is an alias). `aliases` maps alias ->
    canonical. A manifest may name a tied parameter by any of its names, but only once.
    """
    return check_layout(m) + check_names(m.tensors, params, aliases, m.partial)


def check_names(tensors: Sequence[TensorSpec], params: Mapping[str, ParamInfo],
                aliases: Mapping[str, str] | None = None, partial: bool = False) -> list[str]:
    """validate_manifest's checks of the tensors against the model: every parameter exactly once
    (at most once for a `partial` push), under a name it has, with its shape and a dtype it can take."""
    aliases = aliases or {}
    problems: list[str] = []
    unknown, twice, shape_bad, dtype_bad = [], [], [], []
    covered: dict[str, str] = {}
    for t in tensors:
        canon = t.name if t.name in params else aliases.get(t.name)
        if canon is None:
            unknown.append(t.name)
            continue
        if canon in covered:
            twice.append(f"{t.name} (tied to {covered[canon]})" if covered[canon] != t.name else t.name)
            continue
        covered[canon] = t.name
        info = params[canon]
        if tuple(t.shape) != tuple(info.shape):
            shape_bad.append(f"{t.name} {list(t.shape)} != {list(info.shape)}")
        if t.dtype in _ITEMSIZE and not can_take(t.dtype, info.dtype):
            dtype_bad.append(f"{t.name} {t.dtype} -> {info.dtype}")
    missing = [] if partial else [n for n in params if n not in covered]
    if unknown:
        problems.append(_listing("unknown names", unknown))
    if missing:
        problems.append(_listing("missing names (a push must cover every parameter)", missing))
    if twice:
        problems.append(_listing("parameters given twice", twice))
    if shape_bad:
        problems.append(_listing("wrong shapes (sent != model)", shape_bad))
    if dtype_bad:
        problems.append(_listing("dtypes that cannot be taken (sent -> model)", dtype_bad))
    return problems


def model_params(model: torch.nn.Module) -> tuple[dict[str, torch.nn.Parameter], dict[str, str]]:
    """A model's parameters under canonical names, and its tied aliases (alias -> canonical).

    Canonical = the name `named_parameters()` keeps (the first registered); every further name of
    the same Parameter object is an alias. Buffers are not pushed: they are not trained.
    """
    params = dict(model.named_parameters())
    by_id = {id(p): n for n, p in params.items()}
    aliases = {n: by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n not in params}
    return params, aliases


def param_infos(params: Mapping[str, torch.Tensor]) -> dict[str, ParamInfo]:
    return {n: ParamInfo(dtype_name(p.dtype), tuple(p.shape)) for n, p in params.items()}
