"""The rollout layer: the sidecar server (`python -m rollout.serve`), its manager, and the
trainer's client."""

from rollout.client import AsyncRolloutClient, RolloutClient
from rollout.sidecar_link import SidecarError, SidecarGoneError
from rollout.types import Rollout

__all__ = ["AsyncRolloutClient", "RolloutClient", "Rollout", "SidecarError", "SidecarGoneError"]
