"""vLLM's weight-transfer wire as our manifest (issue 40): what a trainer written for `vllm serve`'s
RL routes sends, read so that our receiver stages it as it stages our own buckets.

vLLM's trainer (vllm/distributed/weight_transfer/packed_tensor.py, `pack_tensors`) sends the tensors
of an update in the order of its `update_info` (`names`, `dtype_names`, `shapes`), each as its raw
bytes, packed into uint8 chunks: a chunk takes tensors until its running byte total exceeds the
buffer size (`packed_buffer_size_bytes` of the init info, 1 GiB by default), so a tensor larger
than the buffer ends the chunk it starts or is one on its own. Each chunk is one broadcast from
rank 0; nothing pads the tensors. As a manifest: alignment 1, one bucket per chunk.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence

from weight_sync.common.manifest import _ITEMSIZE, Bucket, Manifest, TensorSpec, itemsize

DEFAULT_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


def chunk_bounds(sizes: Sequence[int], buffer_bytes: int) -> list[tuple[int, int]]:
    """The chunks vLLM's `pack_tensors` makes of tensors of these byte sizes: [first, last) each."""
    if buffer_bytes < 1:
        raise ValueError(f"packed_buffer_size_bytes must be >= 1, got {buffer_bytes}")
    bounds, first, total = [], 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total > buffer_bytes:  # the tensor that crosses the size closes its chunk
            bounds.append((first, i + 1))
            first, total = i + 1, 0
    if first < len(sizes):
        bounds.append((first, len(sizes)))
    return bounds


def update_problems(update_info: dict) -> list[str]:
    """What is wrong with an `update_info` body, each naming its field (empty: it can be read)."""
    names, dtypes, shapes = (update_info.get(k) for k in ("names", "dtype_names", "shapes"))
    problems = [f"update_info.{k} must be a list" for k, v in
                (("names", names), ("dtype_names", dtypes), ("shapes", shapes)) if not isinstance(v, list)]
    if problems:
        return problems
    if not len(names) == len(dtypes) == len(shapes):
        return [f"update_info lists differ in length: {len(names)} names, {len(dtypes)} dtype_names, "
                f"{len(shapes)} shapes"]
    for n, d, s in zip(names, dtypes, shapes):
        if not isinstance(n, str):
            problems.append(f"update_info.names: {n!r} is not a string")
        elif d not in _ITEMSIZE:
            problems.append(f"update_info.dtype_names: {n}: {d!r} is not a dtype a push carries ({sorted(_ITEMSIZE)})")
        elif not isinstance(s, list) or not all(isinstance(x, int) and x >= 0 for x in s):
            problems.append(f"update_info.shapes: {n}: {s!r} is not a list of sizes")
    return problems


def update_manifest(update_info: dict, buffer_bytes: int = DEFAULT_BUFFER_BYTES, version: int = 0) -> Manifest:
    """The manifest of one vLLM update: its tensors laid end to end, one bucket per chunk.
    Raises ValueError naming the field when the body cannot be read (update_problems)."""
    problems = update_problems(update_info)
    if problems:
        raise ValueError("; ".join(problems))
    specs = list(zip(update_info["names"], update_info["dtype_names"], update_info["shapes"]))
    sizes = [math.prod(shape) * itemsize(dtype) for _, dtype, shape in specs]
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    tensors = [TensorSpec(n, d, tuple(s), off, size) for (n, d, s), off, size in zip(specs, offsets, sizes)]
    buckets = [Bucket(offsets[f], offsets[last - 1] + sizes[last - 1], f, last)
               for f, last in chunk_bounds(sizes, buffer_bytes)]
    return Manifest(version=int(version), tensors=tensors, buckets=buckets, total_bytes=sum(sizes),
                    layout_bytes=sum(sizes), bucket_bytes=int(buffer_bytes), alignment=1, push_id=uuid.uuid4().hex)
