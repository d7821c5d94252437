"""The rollout layer: the sidecar server (`python -m rollout.serve`), its manager, and the
trainer's client."""

from rollout.blocking_client import RolloutClient
from rollout.client import AsyncRolloutClient
from rollout.sidecar_link import SidecarError, SidecarGoneError
from rollout.types import Rollout

__all__ = ["AsyncRolloutClient", "RolloutClient", "Rollout", "SidecarError", "SidecarGoneError"]
