"""The rollout layer, by process: the trainer's client (rollout.client), the sidecar
(rollout.sidecar, started by `python -m rollout.serve`), the HTTP router over sidecars (rollout.router,
`python -m rollout.router`), and what they speak (rollout.common).

The client's names are loaded on first use, so that a sidecar, which imports this package
too, never loads the client's modules (it runs one only to catch a newcomer up)."""

import importlib

_EXPORTS = {
    "AsyncRolloutClient": "rollout.client.async_client",
    "RolloutClient": "rollout.client.blocking_client",
    "SidecarError": "rollout.client.sidecar_link",
    "SidecarGoneError": "rollout.client.sidecar_link",
    "Rollout": "rollout.common.types",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
