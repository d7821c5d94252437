"""A sidecar catching another up: it pushes its newest committed weights to the sidecar at `to`
as a trainer would (its own weight-sync group of one sender and that sidecar's workers; the same
manifest vote, staging, commit vote and checksums as the trainer's push), from its host copy
(rollout.sidecar.supervision), so its own engines go on generating meanwhile. The trainer's client asks
for it when a sidecar joins after its first push (AsyncRolloutClient.add_sidecar): the newcomer's
bytes then cross the peer's link and its own, never the trainer's.

Faults: the receiver dying or its link going down fails this call (the push's own timeouts and
the receiver's stall watch bound it) and changes nothing here; this sidecar dying fails the
receiver's push cleanly (its trainer, this process, is gone), which keeps what it served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

from weight_sync.common.hosts import local_address_towards

log = logging.getLogger(__name__)


async def send_weights(manager, to: str, token: str, timeout_s: float) -> dict:
    """Push this sidecar's newest committed weights to the sidecar at `to` (a tcp:// address,
    `token` its token); answers the version sent, where it came from and what it took."""
    from rollout.client.async_client import AsyncRolloutClient  # the trainer's client, run by this sidecar
    from weight_sync.common.push_dir import read_tensors  # torch: only once a sidecar sends

    host = urlsplit(to).hostname
    if urlsplit(to).scheme != "tcp" or not host:
        raise ValueError(f"send_weights needs the other sidecar's tcp://host:port address, got {to!r}")
    t0 = time.monotonic()
    async with manager.supervisor.newest_weights() as (path, version, source):
        named = await asyncio.to_thread(read_tensors, path)
        client = AsyncRolloutClient(to, token=token, timeout_s=timeout_s)
        try:
            await client.init_weight_sync(host=local_address_towards(host), timeout_s=timeout_s)
            out = await client.push_weights(named, version, timeout_s=timeout_s, delta=False)  # a newcomer has no base
        finally:
            try:
                await asyncio.wait_for(client.close_weight_sync(), 30)
            except Exception as e:  # noqa: BLE001 - a receiver that went has no group left to close
                log.debug("closing the group with %s: %s", to, e)
            await client.close()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    took = time.monotonic() - t0
    log.info("sent version %d (%s, %.1f MB) to %s in %.1f s", version, source, nbytes / 1e6, to, took)
    return {"version": version, "from": source, "bytes": nbytes, "seconds": took, "push": out["sidecars"][0]}
