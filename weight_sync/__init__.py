"""Weight sync: push a trainer's weights into running engines over a dedicated process group
(or, as a fallback, through safetensors files), validated first and never half-applied.

Trainer side: `WeightSender`; `weight_sync.push` runs a push (once, for every caller);
`weight_sync.engine_sync` delivers it to local AsyncEngines.
Engine side: `weight_sync.receiver:WeightSyncExtension`, the worker extension class.
See weight_sync/README.md.
"""

import importlib

EXTENSION = "weight_sync.receiver:WeightSyncExtension"

# Where each public name lives. Imported on first use (PEP 562): the sidecar reads its placement
# (weight_sync.devices) before it imports torch, so this package must not import torch itself.
_HOME = {
    "weights_checksum": "checksum", "GroupError": "group", "WeightSyncGroup": "group", "Manifest": "manifest",
    "build_manifest": "manifest", "plan_layout": "manifest", "validate_manifest": "manifest",
    "DEFAULT_BUCKET_BYTES": "sender", "WeightSender": "sender", "StaleManifestError": "votes",
    "WeightSyncError": "votes", "follow_push": "trainer_ranks", "clean_name": "trainer_weights",
    "flatten_parameters": "trainer_weights", "unwrap_model": "trainer_weights",
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
