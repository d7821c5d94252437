"""LoRA adapter pushes: the trainer sends a PEFT model's adapter (a few MB) instead of the whole
model, and the engine merges it into the base it keeps: `W = W0 + scale * B @ A` for each target
module, from the base `W0` every time, so repeated pushes never accumulate rounding.

Wire: an adapter push is an ordinary manifest (same buckets, votes and all-or-nothing commit)
whose tensors are `<module>.lora_A` [r, in] and `<module>.lora_B` [out, r] under the module's HF
name, with `Manifest.adapter` saying which base they apply to (`base_id`, a checksum of the
trainer's base weights) and each module's scale. An engine whose base is not that one votes
"needs base" before any byte moves; the trainer then pushes once more with the base weights in
the same manifest (`with_base`), which the engine keeps as `W0`. The merge is PEFT's own
arithmetic (`LoraLayer.get_delta_weight`, then `weight += delta`; engine/kernels/lora_merge.py, the engine's
own), so the engine's weights are bit for bit the trainer's `merge_and_unload()` on the same kind of device.

Here: the wire's names and the engine's checks of an adapter
manifest. The trainer's side (a PEFT model's adapter, base and merged weights) is
weight_sync/trainer/lora_push.py; the engine's merge target weight_sync/engine_side/lora_target.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from weight_sync.common.manifest import DTYPES, FLOAT_DTYPES, Manifest, ParamInfo, check_layout, check_names

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
MAX_RANK = 4096  # beyond this an "adapter" is no longer low rank: push it merged


# -- engine side: validation (pure) -------------------------------------------------------------
def adapter_problems(m: Manifest, params: Mapping[str, ParamInfo], aliases: Mapping[str, str] | None = None
                     ) -> list[str]:
    """Every problem that makes adapter manifest `m` unacceptable for a model with `params`: the
    base part (if any) as a full push, and for each target module a `lora_A` [r, in] and `lora_B`
    [out, r] of floating dtypes matching the module's weight [out, in], a sane rank and a finite
    scale. An empty list: the push can go ahead."""
    spec = m.adapter
    lora = [t for t in m.tensors if t.name.endswith((A_SUFFIX, B_SUFFIX))]
    base = [t for t in m.tensors if not t.name.endswith((A_SUFFIX, B_SUFFIX))]
    problems = check_layout(m)
    if spec.with_base:
        problems += check_names(base, params, aliases)
    elif base:
        problems.append(f"an adapter push without its base carries only lora_A / lora_B tensors, got "
                        f"{[t.name for t in base[:4]]}")
    by_name = {t.name: t for t in lora}
    modules = {t.name.rsplit(".", 1)[0] for t in lora}
    if modules != set(spec.scales):
        problems.append(f"modules with tensors {sorted(modules)[:4]} != modules with scales {sorted(spec.scales)[:4]}")
    for module in sorted(spec.scales):
        a, b = by_name.get(module + A_SUFFIX), by_name.get(module + B_SUFFIX)
        w = params.get(module + ".weight")
        if aliases and module + ".weight" in aliases:
            problems.append(f"{module}: its weight is tied to {aliases[module + '.weight']}; an adapter on it would "
                            "change both: push with mode='merged'")
            continue
        if w is None or len(w.shape) != 2:
            problems.append(f"{module}: the model has no linear layer of that name")
            continue
        if a is None or b is None:
            problems.append(f"{module}: needs both {A_SUFFIX} and {B_SUFFIX}")
            continue
        out_f, in_f = w.shape
        r = a.shape[0] if len(a.shape) == 2 else -1
        if not 1 <= r <= MAX_RANK or tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
            problems.append(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not make a rank-r "
                            f"update of its weight {list(w.shape)} (want [r, {in_f}] and [{out_f}, r], 1 <= r <= "
                            f"{MAX_RANK})")
        if a.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES or w.dtype not in FLOAT_DTYPES:
            problems.append(f"{module}: LoRA needs floating dtypes, got {a.dtype}/{b.dtype} for a {w.dtype} weight")
        if not math.isfinite(spec.scales[module]):
            problems.append(f"{module}: scale {spec.scales[module]} is not finite")
    return problems


def adapter_views(m: Manifest, staging: torch.Tensor) -> dict[str, torch.Tensor]:
    """Name -> the tensor's bytes in the staging buffer, as its dtype and shape."""
    return {t.name: staging[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape) for t in m.tensors}
