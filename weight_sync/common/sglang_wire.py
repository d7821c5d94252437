"""SGLang's `update_weights_from_distributed` wire as our manifest (issue 51). The body names the
tensors (`names`, `dtypes`, `shapes`); right after the call the trainer broadcasts them from rank 0:

- one broadcast per tensor, in the body's order, each the tensor itself in its dtype (SGLang's
  `ModelRunner.update_weights_from_distributed`): one bucket per tensor here, laid out at our
  alignment (no byte of the wire depends on where a tensor is staged);
- or, with `load_format="flattened_bucket"`, one uint8 broadcast of every tensor's bytes end to end
  (SGLang's `FlattenedTensorBucket`): alignment 1, one bucket.

Either way the manifest is `partial`: one call may carry a bucket of the update, not all of it.
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
