"""`RolloutClient`: the blocking twin of `AsyncRolloutClient`, for training loops that are not
asyncio. It runs the async client on a private event loop; a client dropped without `close()`
is closed by a finalizer, bounded, so garbage collection never blocks."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Iterator

from rollout.client.async_client import AsyncRolloutClient
from rollout.common.types import Rollout

log = logging.getLogger("rollout.client")


def _abandon(loop: asyncio.AbstractEventLoop, client: AsyncRolloutClient) -> None:
    """A RolloutClient dropped without close(): close it on its own (idle) loop, bounded."""
    try:
        loop.run_until_complete(asyncio.wait_for(client.close(), 5))
    except Exception as e:  # noqa: BLE001 - a finalizer must not raise; the sockets go below anyway
        log.warning("closing a dropped RolloutClient: %s", e)
    client._release()
    loop.close()


class RolloutClient:
    """Blocking twin of AsyncRolloutClient (runs it on a private event loop)."""

    def __init__(self, urls: str | list[str], token: str = "", timeout_s: float = 600.0):
        self._loop = asyncio.new_event_loop()
        self._client = self._run(_make(urls, token, timeout_s))
        self._abandon = weakref.finalize(self, _abandon, self._loop, self._client)

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    @property
    def urls(self) -> list[str]:
        return self._client.urls

    @property
    def states(self) -> dict[str, str]:
        """As AsyncRolloutClient.states (as of this client's last call: its loop runs in its calls)."""
        return self._client.states

    def generate(self, prompts: list, sampling_params=None, sessions=None) -> list[list[Rollout]]:
        return self._run(self._client.generate(prompts, sampling_params, sessions))

    def generate_iter(self, prompts: list, sampling_params=None, sessions=None) -> Iterator[tuple[int, list[Rollout]]]:
        agen = self._client.generate_iter(prompts, sampling_params, sessions)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    def end_session(self, session: str) -> None:
        self._client.end_session(session)

    def placement_stats(self) -> dict:
        return self._client.placement_stats()

    def add_sidecar(self, url: str, wait: bool = False) -> None:
        """As AsyncRolloutClient.add_sidecar. `wait=False`: the peer sending it the weights works on
        its own; this client learns it serves whenever its loop runs (its next call)."""
        self._run(self._client.add_sidecar(url, wait))

    def remove_sidecar(self, url: str) -> None:
        self._run(self._client.remove_sidecar(url))

    def init_weight_sync(self, host: str | None = None, port: int = 0, timeout_s: float = 120.0,
                         bucket_bytes: int | None = None, device=None, take_over: bool = False) -> dict:
        return self._run(self._client.init_weight_sync(host, port, timeout_s, bucket_bytes, device, take_over))

    def push_weights(self, model_or_named_tensors, version: int, pause_mode: str | None = None,
                     timeout_s: float = 300.0, progress=None, transport: str = "group", wait: bool = True,
                     mode: str = "adapter", delta: bool | None = None):
        """As AsyncRolloutClient.push_weights; `wait=False` returns a `BlockingPushHandle`."""
        out = self._run(self._client.push_weights(model_or_named_tensors, version, pause_mode, timeout_s, progress,
                                                  transport, wait, mode, delta))
        return out if wait else BlockingPushHandle(self, out)

    def load_weights(self, path: str, version: int, pause_mode: str | None = None,
                     timeout_s: float = 300.0) -> list[dict]:
        return self._run(self._client.load_weights(path, version, pause_mode, timeout_s))

    def close_weight_sync(self) -> None:
        self._run(self._client.close_weight_sync())

    def weights_checksums(self) -> list[str]:
        return self._run(self._client.weights_checksums())

    def checksum_of(self, model_or_named_tensors) -> str:
        return self._client.checksum_of(model_or_named_tensors)

    def sleep(self, level: int = 1) -> None:
        self._run(self._client.sleep(level))

    def wake_up(self) -> None:
        self._run(self._client.wake_up())

    def stats(self) -> list[dict] | dict:
        s = self._run(self._client.stats())
        return s[0] if self._client.single else s

    def health(self) -> list[dict] | dict:
        h = self._run(self._client.health())
        return h[0] if self._client.single else h

    def load(self) -> list[dict] | dict:
        out = self._run(self._client.load())
        return out[0] if self._client.single else out

    def close(self) -> None:
        self._abandon()  # the same steps as for a dropped client, once

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BlockingPushHandle:
    """A push that returned early (wait=False); the swap goes on in the sidecars. Its replies are
    read whenever this client's loop runs: in `result()` or in the client's next call."""

    def __init__(self, client: RolloutClient, handle):
        self._client, self._handle = client, handle
        self.version = handle.version

    def done(self) -> bool:
        self._client._run(asyncio.sleep(0))  # one turn of the loop: replies that came are read
        return self._handle.done()

    def result(self, timeout: float | None = None) -> dict:
        """push_weights' result once every engine swapped; raises its error (SidecarError), or
        TimeoutError after `timeout` seconds (the push goes on)."""
        return self._client._run(asyncio.wait_for(asyncio.shield(self._handle.task), timeout))

    def __repr__(self) -> str:
        return f"BlockingPushHandle(version={self.version}, {'done' if self._handle.done() else 'swapping'})"


async def _make(urls, token, timeout_s) -> AsyncRolloutClient:
    return AsyncRolloutClient(urls, token, timeout_s)
