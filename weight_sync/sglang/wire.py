"""SGLang's `update_weights_from_distributed` wire as our manifest (issue 51). The body names the
tensors (`names`, `dtypes`, `shapes`); right after the call the trainer broadcasts them from rank 0:

- one broadcast per tensor, in the body's order, each the tensor itself in its dtype (SGLang's
  `ModelRunner.update_weights_from_distributed`): one bucket per tensor here, laid out at our
  alignment (no byte of the wire depends on where a tensor is staged);
- or, with `load_format="flattened_bucket"`, one uint8 broadcast of every tensor's bytes end to end
  (SGLang's `FlattenedTensorBucket`): alignment 1, one bucket.

Either way the manifest is `partial`: one call may carry a bucket of the update, not all of it.

Tied weights: a trainer that sends its state dict (TorchRL) names a tied parameter twice
(`lm_head.weight` and `model.embed_tokens.weight`); SGLang's loaders skip the tied `lm_head.weight`.
`update_parts` gives such an alias a part of its own, so that each part names a parameter once; the
engine then checks that its bytes equal the parameter's (weight_sync/engine_side/held_parts.py).
"""

from __future__ import annotations

import math
import uuid

from weight_sync.common.manifest import _ITEMSIZE, ALIGNMENT, Bucket, Manifest, TensorSpec, itemsize, plan_layout

LOAD_FORMATS = (None, "flattened_bucket")


def update_problems(body: dict) -> list[str]:
    """What keeps the body from being read, each naming its field (empty: it can be read)."""
    names, dtypes, shapes = (body.get(k) for k in ("names", "dtypes", "shapes"))
    problems = [f"{k} must be a list" for k, v in (("names", names), ("dtypes", dtypes), ("shapes", shapes))
                if not isinstance(v, list)]
    if problems:
        return problems
    if not len(names) == len(dtypes) == len(shapes):
        return [f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"]
    if not names:
        return ["names: an update names at least one tensor"]
    for n, d, s in zip(names, dtypes, shapes):
        if not isinstance(n, str):
            problems.append(f"names: {n!r} is not a string")
        elif not isinstance(d, str) or d.removeprefix("torch.") not in _ITEMSIZE:
            problems.append(f"dtypes: {n}: {d!r} is not a dtype a push carries ({sorted(_ITEMSIZE)})")
        elif not isinstance(s, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            problems.append(f"shapes: {n}: {s!r} is not a list of sizes")
    if body.get("load_format") not in LOAD_FORMATS:
        problems.append(f"load_format: {body.get('load_format')!r} is not one of {list(LOAD_FORMATS)}")
    return problems


def update_manifest(body: dict, version: int = 0) -> Manifest:
    """The manifest of one call; ValueError naming the field when the body cannot be read."""
    problems = update_problems(body)
    if problems:
        raise ValueError("; ".join(problems))
    specs = [(n, d.removeprefix("torch."), tuple(s)) for n, d, s in zip(body["names"], body["dtypes"], body["shapes"])]
    sizes = [math.prod(shape) * itemsize(dtype) for _, dtype, shape in specs]
    if body.get("load_format") == "flattened_bucket":
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        layout, alignment, buckets = sum(sizes), 1, [Bucket(0, sum(sizes), 0, len(sizes))]
    else:
        offsets, layout, _ = plan_layout(sizes, 1, ALIGNMENT)
        alignment = ALIGNMENT
        buckets = [Bucket(off, off + n, i, i + 1) for i, (off, n) in enumerate(zip(offsets, sizes))]
    tensors = [TensorSpec(n, d, s, off, size) for (n, d, s), off, size in zip(specs, offsets, sizes)]
    return Manifest(version=int(version), tensors=tensors, buckets=buckets, total_bytes=sum(sizes),
                    layout_bytes=layout, bucket_bytes=max(1, layout), alignment=alignment,
                    push_id=uuid.uuid4().hex, partial=True)


def tied_aliases(tie_word_embeddings: bool, served: set[str]) -> dict[str, str]:
    """SGLang's rule (its loaders skip `lm_head.weight` when the config ties word embeddings): the
    tied output embedding -> the input embedding it is served as; {} when nothing is tied."""
    embeds = [n for n in served if n.endswith("embed_tokens.weight")]
    if not tie_word_embeddings or "lm_head.weight" in served or len(embeds) != 1:
        return {}
    return {"lm_head.weight": embeds[0]}


def update_parts(body: dict, version: int, tied: dict[str, str]) -> list[Manifest]:
    """The call's manifests in broadcast order: every tied alias (`tied`: alias -> the name the
    engine serves it under) that the call names with its parameter alone in a part, so that no part
    names a parameter twice. ValueError naming the field when the body cannot be read, or an
    alias whose dtype or shape differs from its parameter's."""
    problems = update_problems(body)
    if problems:
        raise ValueError("; ".join(problems))
    names = body["names"]
    spec = {n: (d.removeprefix("torch."), list(s)) for n, d, s in zip(names, body["dtypes"], body["shapes"])}
    split = [n for n in names if n in tied and tied[n] in spec]
    wrong = [f"{n} {spec[n][0]} {spec[n][1]} != {tied[n]} {spec[tied[n]][0]} {spec[tied[n]][1]}"
             for n in split if spec[n] != spec[tied[n]]]
    if wrong:
        raise ValueError("shapes: tied weights that differ from the weight they are tied to: " + ", ".join(wrong))
    if not split or body.get("load_format") == "flattened_bucket":  # one broadcast: one part
        return [update_manifest(body, version)]
    cuts = sorted({0, len(names)} | {i for i, n in enumerate(names) if n in split}
                  | {i + 1 for i, n in enumerate(names) if n in split})
    return [update_manifest({**body, **{k: body[k][a:b] for k in ("names", "dtypes", "shapes")}}, version)
            for a, b in zip(cuts, cuts[1:])]
