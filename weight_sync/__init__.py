"""Weight sync: push a trainer's weights into running engines over a dedicated process group
(or, as a fallback, through safetensors files), validated first and never half-applied.

Four places, one per side of a push (weight_sync/README.md draws them):
- `weight_sync.trainer`: the trainer's half (`WeightSender`; `weight_sync.trainer.push` runs a
  push, once, for every caller);
- `weight_sync.engine_side`: the engine's half (`PushReceiver` over `WeightTarget`s, the worker
  extension `weight_sync.engine_side.extension:WeightSyncExtension`, and the calls that drive an
  engine's workers from the process holding the engine);
- `weight_sync.common`: what both halves stand on (the group, manifest, votes, digests, deltas);
- `weight_sync.vllm`: vLLM's compatibility (its worker extension, its trainers' groups and wire).
"""

import importlib

EXTENSION = "weight_sync.engine_side.extension:WeightSyncExtension"

# Where each public name lives. Imported on first use (PEP 562): the sidecar reads its placement
# (weight_sync.common.devices) before it imports torch, so this package must not import torch itself.
_HOME = {
    "weights_checksum": "common.checksum", "GroupError": "common.group", "WeightSyncGroup": "common.group",
    "DEFAULT_BUCKET_BYTES": "common.manifest", "Manifest": "common.manifest", "build_manifest": "common.manifest",
    "plan_layout": "common.manifest", "validate_manifest": "common.manifest", "StaleManifestError": "common.votes",
    "WeightSyncError": "common.votes", "WeightSender": "trainer.sender", "follow_push": "trainer.ranks",
    "clean_name": "trainer.weights", "flatten_parameters": "trainer.weights", "unwrap_model": "trainer.weights",
}

__all__ = [
    "DEFAULT_BUCKET_BYTES", "EXTENSION", "GroupError", "Manifest", "StaleManifestError", "WeightSender", "WeightSyncError",
    "WeightSyncGroup", "build_manifest", "clean_name", "flatten_parameters", "follow_push", "plan_layout", "unwrap_model",
    "validate_manifest", "weights_checksum",
]


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'weight_sync' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"weight_sync.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
