"""Derived copies of a module's weight: what its forward reads instead of the weight itself (a
oneDNN-prepacked copy, engine/kernels/packed_linears.py; an 8-bit copy), built from the full-precision
weight, which stays the truth that checksums, digests, deltas and host copies read.

A kind of derived copy registers per module with `attach(module, derive)`, where
`derive(weight) -> copy` makes the copy from a full-precision weight (the parameter, or the staged
tensor of a push, in the parameter's dtype); its forward reads `current(module)`, the copy kept in
`module._derived`, made again there only if the weight changed since (its data pointer, version
counter or shape moved: a test's `copy_`, a reload, a LoRA merge written in place).

A push builds the copies from its staged weights while the engine still serves the old ones
(`stage`, on the receiving thread), and its commit swaps them in with the weights (`install`),
so no forward after a commit derives anything. A copy staged for a weight the push did not change
(a delta's untouched tensors) is the one already served. Until `install`, the staged copies are
held only by the push: a push refused or given up drops them, and the old copies keep serving.

A group (`attach_group`: a layer's q/k/v projections, its gate/up) is served by one copy derived
from its members' weights stacked by rows, so one GEMM does the work of three; it is staged,
installed and dropped like a module's copy, and a member's own copy is made only if the member
runs alone (a LoRA hook on it).

A kind whose derive takes `parts` (`takes_parts(derive)`: the fp32 panels) is called as
`derive(weights, into=copy)`: a group's members' weights as a list (packed where they lie, no stacked
copy) and a retired copy of the same shape whose memory it may write instead of fresh memory. A
commit that keeps what it replaced (`install(..., keep_replaced=True)`: a sidecar that keeps its
staging between pushes, trading memory for pages that need not fault in again) holds the copies it
retired as the next push's spares: fresh pages faulted in at ~1 GB/s here, several times the
pack's own time (an adapter push re-derives every linear it merged into).

A kind that reads the weights in place (`in_place`: `WeightRows`, the bf16 AMX kernel or the fp32
one on the parameters' own rows) is a copy of no bytes: deriving it takes pointers, and a group's
is given its members' weights as they are, never stacked. A push stages none of them: its commit
drops those of the weights it wrote, and the first forward after takes the new weights' pointers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

Derive = Callable[[torch.Tensor], object]


def takes_parts(derive) -> bool:
    """Whether `derive` is called as derive(tensor or list of tensors, into=retired copy) (see the header)."""
    return getattr(derive, "takes_parts", False)


def _derive(derive, weights: list, into=None):
    """`derive` of weights stacked by rows (one tensor: a module's own), parts and spare where it takes them."""
    if takes_parts(derive):
        return derive(weights[0] if len(weights) == 1 else weights, into=into)
    return derive(weights[0] if len(weights) == 1 else torch.cat(weights))


def spares(model: torch.nn.Module) -> dict:
    """The copies a commit retired and kept for the next push's (module or Group -> copy)."""
    return model.__dict__.setdefault("_spare_copies", {})


@dataclass(frozen=True)
class PackedWeight:
    """A [n, k] weight laid out once for one of our kernels (amx_linears.AmxWeight,
    f32_linears.F32Weight): the derived copy its forward reads."""

    packed: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


@dataclass(frozen=True, eq=False)
class WeightRows:
    """A copy that is no copy: a linear served from its weights as they are (the bf16 AMX kernel,
    engine/kernels/amx_linears.py; the fp32 one, engine/kernels/f32_linears.py), the parameter's own rows or a
    group's members' rows one after the other (q/k/v, gate/up), read in place. What a push or a LoRA
    merge writes is what it reads, and deriving it is taking the pointers. `desc` is the segments
    as the kernels take them, [count, 3 pointers, 3 row counts] (int64, unused slots 0); `weights`
    keeps them alive."""

    weights: tuple
    desc: torch.Tensor
    n: int
    k: int
    nbytes = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.weights[0].dtype


def rows_of(weights) -> WeightRows:
    """The in-place copy serving `weights` (a tensor, or a group's list of at most three)."""
    weights = (weights,) if isinstance(weights, torch.Tensor) else tuple(weights)
    pad = [0] * (3 - len(weights))
    desc = torch.tensor([len(weights), *[w.data_ptr() for w in weights], *pad, *[w.shape[0] for w in weights], *pad],
                        dtype=torch.int64)
    return WeightRows(weights, desc, sum(w.shape[0] for w in weights), weights[0].shape[1])


def attach(module: torch.nn.Module, derive: Derive, in_place: bool = False) -> None:
    """Serve `module`'s forward from `derive(module.weight)` (made at its first forward, `refresh`,
    or a push's `stage`). `in_place`: the copy reads the weight where it is (see the header)."""
    module._derive, module._derived, module._derived_key = derive, None, None
    module._derive_in_place = in_place


def derived_modules(model: torch.nn.Module):
    return (m for m in model.modules() if hasattr(m, "_derive"))


@dataclass(eq=False)
class Group:
    """Modules served together from one copy of their weights stacked by rows (see the header)."""

    members: tuple
    derive: Derive
    copy: object = None
    key: tuple | None = None
    in_place: bool = False  # derive takes the members' weights as they are, not stacked

    def stale(self) -> bool:
        return self.key != tuple(key(m.weight) for m in self.members)


def attach_group(model: torch.nn.Module, members, derive: Derive) -> Group:
    g = Group(tuple(members), derive, in_place=all(in_place(m) for m in members))
    model._derived_groups = [*groups(model), g]
    for m in g.members:
        m._group = g
        m._derived, m._derived_key = None, None  # the group's copy serves it
    return g


def groups(model: torch.nn.Module) -> list[Group]:
    return getattr(model, "_derived_groups", [])


def current_group(g: Group):
    """The group's copy, derived again if any member's weight changed since."""
    if g.stale():
        k = tuple(key(m.weight) for m in g.members)  # before the copy, as in `current`
        weights = [m.weight.detach() for m in g.members]
        g.copy = g.derive(weights) if g.in_place else _derive(g.derive, weights)
        g.key = k
    return g.copy


def in_place(m: torch.nn.Module) -> bool:
    """Whether `m`'s copy reads its weight in place (nothing to stage for a push)."""
    return getattr(m, "_derive_in_place", False)


def _alone(m: torch.nn.Module) -> bool:
    """Whether `m` needs a copy of its own: not in a group, or run alone once already."""
    return getattr(m, "_group", None) is None or m._derived is not None


def key(weight: torch.Tensor) -> tuple:
    """What tells a weight's copy stale: data pointer, version counter, shape."""
    try:
        version = weight._version
    except RuntimeError:  # an inference-mode tensor counts no versions (and takes no writes outside it)
        version = -1
    return weight.data_ptr(), version, tuple(weight.shape)


def current(module: torch.nn.Module):
    """The copy `module`'s forward uses, derived again if its weight changed since."""
    w = module.weight
    k = key(w)
    if module._derived_key != k:
        # NOTE: the copy before the key: `stage` on another thread reads the key first, so a key it
        # finds current always comes with its own copy.
        module._derived = module._derive(w.detach())
        module._derived_key = k
    return module._derived


def refresh(model: torch.nn.Module) -> None:
    """Derive every stale copy now, not at the next forward."""
    for module in derived_modules(model):
        if module.weight.numel() and _alone(module):
            current(module)
    for g in groups(model):
        if all(m.weight.numel() for m in g.members):
            current_group(g)


def reserve_spares(model: torch.nn.Module) -> int:
    """Memory for the first push's copies, laid out as the served ones and its pages faulted in now, for
    every copy a push derives into a retired copy's memory (`takes_parts`): what a commit that keeps what
    it replaced (`install(..., keep_replaced=True)`) holds from the second push on, held from the start,
    so that the first push's derive, too, writes memory already there (fresh pages fault in at 0.5-1
    GB/s on these VMs: a bf16 MoE's first push on AVX2 spent 4.5 s of its 5.4 there). Derives stale
    copies first. Returns the bytes reserved."""
    refresh(model)
    spare, total = spares(model), 0
    owners = [(m, m._derived, m._derive) for m in derived_modules(model) if _alone(m) and not in_place(m)]
    owners += [(g, g.copy, g.derive) for g in groups(model) if not g.in_place]
    for owner, copy, derive in owners:
        if owner in spare or not takes_parts(derive) or not isinstance(copy, PackedWeight):
            continue
        spare[owner] = dataclasses.replace(copy, packed=torch.zeros_like(copy.packed))  # zeros: pages in now
        total += copy.nbytes
    return total


def copy_tensors(model: torch.nn.Module):
    """The CPU or device tensors the current copies hold (a packed copy's `packed`, an 8-bit copy's
    packed weight): what a forward streams instead of the weights."""
    return _tensors(_served_copies(model))


def _served_copies(model: torch.nn.Module) -> list:
    """The copies the forward reads now: each derived module's, then each group's (None where none)."""
    return [m._derived for m in derived_modules(model)] + [g.copy for g in groups(model)]


def spare_tensors(model: torch.nn.Module):
    """The tensors of the copies kept as the next push's memory (`spares`)."""
    return _tensors(spares(model).values())


def _tensors(copies):
    for c in copies:
        while c is not None and not isinstance(c, torch.Tensor):
            c = getattr(c, "packed", None)
        if c is not None:
            yield c


def drop(model: torch.nn.Module) -> None:
    """Free the derived copies (weights written with no copies staged, or released)."""
    for module in derived_modules(model):
        module._derived, module._derived_key = None, None
    for g in groups(model):
        g.copy, g.key = None, None
    spares(model).clear()


@dataclass
class StagedCopies:
    """A push's derived copies, made from its staged tensors: `copies` by module, for every derived
    module whose weight the push writes; `written`, the ids of every parameter it writes."""

    copies: dict = field(default_factory=dict)  # module or Group -> copy
    written: set = field(default_factory=set)
    derived: int = 0  # how many were derived (the rest carried over: unchanged by a delta)
    seconds: float = 0.0


def stage(model: torch.nn.Module, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
          unchanged: set | None = None) -> StagedCopies:
    """The derived copies a commit of `pairs` ((parameter, staged tensor)) will serve, made now from
    the staged tensors. `unchanged`: ids of parameters whose staged values equal the served ones (a
    delta's untouched tensors): their current copy is carried over when it is fresh."""
    t0 = time.perf_counter()
    pairs = list(pairs)
    by_weight: dict[int, list] = {}
    for m in derived_modules(model):
        by_weight.setdefault(id(m.weight), []).append(m)
    out = StagedCopies(written={id(p) for p, _ in pairs})
    spare = spares(model)
    with torch.no_grad():
        for p, staged in pairs:
            for m in by_weight.get(id(p), ()):
                if not _alone(m) or in_place(m):
                    continue  # served by its group's copy, staged below; or nothing to stage
                served_key = m._derived_key
                copy = m._derived
                if unchanged is not None and id(p) in unchanged and copy is not None and served_key == key(p):
                    out.copies[m] = copy
                    continue
                w = staged if staged.dtype == p.dtype else staged.to(p.dtype)  # what a copy commit would hold
                out.copies[m] = _derive(m._derive, [w.detach()], spare.pop(m, None))
                out.derived += 1
        _stage_groups(model, {id(p): s for p, s in pairs}, unchanged, out)
    out.seconds = time.perf_counter() - t0
    return out


def _stage_groups(model, staged_of: dict, unchanged: set | None, out: StagedCopies) -> None:
    """The groups' copies for `stage`: from the staged tensors of the members a push writes and the
    served weights of the others (a push writing one member of a group rebuilds the group's copy)."""
    for g in groups(model):
        ids = [id(m.weight) for m in g.members]
        if g.in_place or not any(i in staged_of for i in ids):
            continue
        if unchanged is not None and all(i in unchanged for i in ids if i in staged_of) and not g.stale():
            out.copies[g] = g.copy
            continue
        parts = [staged_of[id(m.weight)].to(m.weight.dtype) if id(m.weight) in staged_of else m.weight
                 for m in g.members]
        out.copies[g] = _derive(g.derive, [t.detach() for t in parts], spares(model).pop(g, None))
        out.derived += 1


def install(model: torch.nn.Module, staged: StagedCopies | None, keep_replaced: bool = False,
            in_place: bool = False) -> None:
    """After a commit wrote the weights: serve the staged copies; a derived module whose weight was
    written with no copy staged is dropped (derived again at its next forward), the rest keep theirs.
    `staged=None`: what was written is not known, every copy is dropped. `keep_replaced`: the copies
    replaced are kept as the next push's spares (see the header), where their kind takes them.
    `in_place`: a staged copy laid out as the one it replaces is copied into it, so the served copy's
    memory stays where it was (what CUDA graphs captured read: engine/decode_graphs.py)."""
    if staged is None:
        drop(model)
        return
    spare = spares(model)

    def retire(owner, old, derive):
        if keep_replaced and old is not None and takes_parts(derive):
            spare[owner] = old

    def served(old, copy):
        if in_place and old is not None and copy is not None and copy is not old and copy_into(old, copy):
            return old
        return copy

    for m in derived_modules(model):
        copy = staged.copies.get(m)
        if copy is not None or id(m.weight) in staged.written:
            copy = served(m._derived, copy)
            if copy is not m._derived:
                retire(m, m._derived, m._derive)
            m._derived, m._derived_key = copy, (key(m.weight) if copy is not None else None)
    for g in groups(model):
        copy = staged.copies.get(g)
        if copy is not None or any(id(m.weight) in staged.written for m in g.members):
            copy = served(g.copy, copy)
            if copy is not g.copy:
                retire(g, g.copy, g.derive)
            g.copy, g.key = copy, (tuple(key(m.weight) for m in g.members) if copy is not None else None)


def copy_into(old, new) -> bool:
    """`new`'s tensors copied into `old`'s where the two copies are laid out alike (the same kind,
    tensor shapes, dtypes, strides and devices, their other fields equal): True; else False, and
    nothing is written."""
    pairs: list = []
    if not _alike(old, new, pairs):
        return False
    with torch.no_grad():
        for a, b in pairs:
            a.copy_(b)
    return True


def _alike(a, b, pairs: list) -> bool:
    if isinstance(a, torch.Tensor):
        same = (isinstance(b, torch.Tensor) and a.layout == b.layout == torch.strided and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride())
        if same:
            pairs.append((a, b))
        return same
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(_alike(getattr(a, f.name), getattr(b, f.name), pairs)
                                          for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_alike(x, y, pairs) for x, y in zip(a, b))
    return type(a) is type(b) and bool(a == b)


def served_tensors(model: torch.nn.Module):
    """Every tensor the served copies hold (an 8-bit copy's scales too, not only what `copy_tensors`
    streams): where a forward reads them."""
    def walk(c):
        if isinstance(c, torch.Tensor):
            yield c
        elif dataclasses.is_dataclass(c) and not isinstance(c, type):
            for f in dataclasses.fields(c):
                yield from walk(getattr(c, f.name))
        elif isinstance(c, (tuple, list)):
            for x in c:
                yield from walk(x)

    for c in _served_copies(model):
        yield from walk(c)
