"""What the trainer's side of a push needs of the sidecars: `PushLinks`, the few calls that
`WeightSyncClient` (rollout/client/weight_sync_client.py) makes over the client's links. The client's
`SidecarSet` (rollout/client/sidecar_set.py) is the real one; a unit test scripts its own.

A sidecar is named by its index for good; its state is one of rollout.client.sidecar_link's (active,
catching up, joining, dropped). Every call fails with SidecarError (the sidecar's reason and kind)
or, when the sidecar went, SidecarGoneError.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol


class PushLinks(Protocol):
    def members(self, *states: str) -> list[int]:
        """The sidecars in these states, in the order they were added."""

    def url(self, i: int) -> str:
        """Sidecar i's address, for names in replies and errors."""

    def state(self, i: int) -> str:
        """Sidecar i's state now (a call that failed may have dropped it)."""

    async def call(self, i: int, call_type, what: str, timeout: float | None = None, **fields) -> Any:
        """Sends sidecar i one call (a rollout.common.protocol message type and its fields) and returns its reply's value."""

    async def ask_all(self, call_type, what: str, timeout: float | None, states, **fields) -> list[tuple[int, Any]]:
        """One call to every sidecar in `states`: (sidecar, value) each; one that went is left out, none left raises."""

    def drop(self, i: int, reason: str) -> None:
        """Sidecar i leaves for good: every call waiting on it fails with SidecarGoneError."""

    def pushed(self, members: Iterable[int], version: int) -> list[int]:
        """`version` committed on `members`: joining ones serve; returns the active ones that missed it (they wait)."""

    def gone_reasons(self) -> str:
        """Why the dropped sidecars went, for an error message."""
