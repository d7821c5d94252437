"""The trainer's side: the clients (`AsyncRolloutClient`, the blocking `RolloutClient`), their links to
the sidecars, the spread of prompts over them and the trainer's half of a push. Never imports the
sidecar (rollout.sidecar); speaks to it through rollout.common."""

from rollout.client.async_client import AsyncRolloutClient
from rollout.client.blocking_client import RolloutClient
from rollout.client.sidecar_link import SidecarError, SidecarGoneError

__all__ = ["AsyncRolloutClient", "RolloutClient", "SidecarError", "SidecarGoneError"]
