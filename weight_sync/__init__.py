"""Weight sync: push a trainer's weights into running engines over a dedicated process group
(or, as a fallback, through safetensors files), validated first and never half-applied.

Trainer side: `WeightSender`; `weight_sync.push` runs a push (once, for every caller);
`weight_sync.engine_sync` delivers it to local AsyncEngines.
Engine side: `weight_sync.receiver:WeightSyncExtension`, the worker extension class.
See weight_sync/README.md.
"""

from weight_sync.checksum import weights_checksum
from weight_sync.group import GroupError, WeightSyncGroup
from weight_sync.manifest import Manifest, build_manifest, plan_layout, validate_manifest
from weight_sync.sender import DEFAULT_BUCKET_BYTES, WeightSender
from weight_sync.votes import StaleManifestError, WeightSyncError
from weight_sync.trainer_ranks import follow_push
from weight_sync.trainer_weights import clean_name, flatten_parameters, unwrap_model

EXTENSION = "weight_sync.receiver:WeightSyncExtension"

__all__ = [
    "DEFAULT_BUCKET_BYTES", "EXTENSION", "GroupError", "Manifest", "StaleManifestError", "WeightSender", "WeightSyncError",
    "WeightSyncGroup", "build_manifest", "clean_name", "flatten_parameters", "follow_push", "plan_layout", "unwrap_model", "validate_manifest",
    "weights_checksum",
]
