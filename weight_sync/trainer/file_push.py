"""The file fallback, the trainer's end: a push of a model written as a push directory
(weight_sync/common/push_dir.py says what one holds and how it is written whole).

Memory: safetensors writes from a dict of every tensor. CPU parameters are referenced, not
copied; DTensors and CUDA tensors are gathered / copied to host memory first (one full host copy
of the model while writing).
"""

from __future__ import annotations

import os

import torch

from weight_sync.common.manifest import Manifest
from weight_sync.common.push_dir import write_tensors
from weight_sync.trainer.weights import full, named_weights


def write_safetensors(weights, path: str | os.PathLike, version: int, dtype: torch.dtype | None = None) -> Manifest:
    """Write a push of `weights` (module or (name, tensor) pairs, as WeightSender takes) to the
    directory `path`; returns its manifest (also saved as manifest.json)."""
    with named_weights(weights) as named:
        tensors = {}
        for name, t in named:
            t = full(t)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name] = t.detach().to("cpu").contiguous()
    return write_tensors(tensors, path, version)
