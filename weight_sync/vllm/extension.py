"""Our weight receiver inside vLLM's workers: `VllmWeightSyncExtension`, vLLM's
`worker_extension_cls` for `rollout.serve --engine vllm` (engine/vllm_start.py passes it).

The same facade as weight_sync/engine_side/extension.py over the same protocol (`PushReceiver`: manifest vote,
staging, commit vote, all or nothing; the overlapped receive, the shared-memory and file
transports); only the target differs: vLLM's loaders (weight_sync/vllm/target.py).

vLLM's errors cross its process boundary as text only, so every call here answers its error as
data ({"error", "error_kind"}); engine/vllm_engine.py raises it as our engine would (a refusal as
a ValueError, which the sidecar reads as "nothing changed"; torn weights as EngineUnhealthyError).
"""

from __future__ import annotations

import functools

from engine.errors import INVALID, error_kind
from weight_sync.engine_side.extension import WeightSyncExtension
from weight_sync.engine_side.staging_memory import StagingPool
from weight_sync.vllm.target import VllmLoaderTarget

VLLM_EXTENSION = "weight_sync.vllm.extension.VllmWeightSyncExtension"  # vLLM takes dotted names


class _VllmSyncExtension(WeightSyncExtension):
    """The receiver with vLLM's worker as its host (`self.model_runner`, `self.vllm_config`,
    `self.rank`, `self.device`)."""

    def _new_target(self, pool: StagingPool) -> VllmLoaderTarget:
        return VllmLoaderTarget(self, pool)

    def _local_rank(self) -> int:
        return int(self.rank)  # this worker's rank in its engine (tensor parallel)

    def zero_weights(self) -> bool:
        raise ValueError("zeroing the weights is our engine's (a vLLM engine serves its own fused copies, which "
                         "the kept copy of the pushed weights would no longer describe)")

    # NOTE: vLLM sends a worker's answer as soon as its method returns: a Future cannot wait for
    # it. A call that must wait answers instead with where to ask (engine/vllm_engine.py's
    # `deferred`): the method to call between steps, its arguments, and the answer meaning "not yet".
    def begin_receive_weights(self, manifest, group_name: str | None = None) -> dict:
        self._overlapped().begin(manifest, group_name)
        return {"deferred": "staged_weights", "args": [], "pending": "receiving"}

    def begin_receive_foreign(self, manifest) -> dict:
        self._overlapped().begin(manifest, foreign=True)
        return {"deferred": "staged_weights", "args": [], "pending": "receiving"}

    def save_weights(self, path: str, version: int, background: bool = False) -> dict:
        """Rank 0 writes the engine's weights (every rank holds them whole); other ranks write nothing."""
        if self.rank != 0:
            return {"path": path, "bytes": 0, "seconds": 0.0}
        out = super().save_weights(path, version, background)
        return {"deferred": "saved_weights", "args": [path], "pending": None} if background else out

    def saved_weights(self, path: str) -> dict | None:
        if self.rank != 0:
            return {"path": path, "bytes": 0, "seconds": 0.0}
        return super().saved_weights(path)


def _errors_as_data(fn):
    """vLLM passes a worker's exception on as its message alone, which would lose its kind: an
    error is answered as data instead, {"error", "error_kind"} (engine/messages.py's kinds; a
    TypeError from the call's own arguments is the caller's fault too), and
    VllmEngine.collective_rpc raises it as our engine would."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every error goes back as data
            kind = INVALID if isinstance(e, TypeError) else error_kind(e)
            return {"error": f"{type(e).__name__}: {e}", "error_kind": kind}
    return call


def _public_rpcs(cls) -> dict:
    return {name: _errors_as_data(getattr(cls, name)) for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))}


VllmWeightSyncExtension = type("VllmWeightSyncExtension", (_VllmSyncExtension,), {
    **_public_rpcs(_VllmSyncExtension), "__module__": __name__,
    "__doc__": "vLLM's worker_extension_cls: the receiver's RPCs, each error answered as data."})
