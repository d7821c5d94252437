"""A sidecar added mid-run caught up from a live one: a live sidecar sends it the newest committed
weights (P.SendWeights, rollout.sidecar.peer_send: over the sidecars' links, not the trainer's) while the
trainer's pushes go on without it; it serves once it holds the version the client wants. With no
live peer to take them from, or rounds spent, it joins at the next push instead.

Link management, not a push: it moves one link between "catching up", "active" and "joining"
(rollout.client.sidecar_link); the version it must reach is the client's word (`newest`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rollout.common import protocol as P
from rollout.client.sidecar_link import ACTIVE, CATCHING_UP, DROPPED, SidecarError
from rollout.client.sidecar_set import SidecarSet

log = logging.getLogger("rollout.client")


async def catch_up(links: SidecarSet, i: int, newest: Callable[[], Awaitable[int]], asked: asyncio.Event,
                   timeout_s: float, rounds: int = 4) -> None:
    """Sidecar i (catching up) is sent the newest committed weights by a live sidecar; `asked` is
    set once a peer was asked (or nothing will be). Each round first asks the newcomer itself: a
    push into it (another client's catch-up) is waited out, and weights it already holds are
    enough. A push that lands meanwhile means one more round; a peer that fails, another peer;
    none left, or rounds spent: it joins at the next push."""
    failed: set[int] = set()
    try:
        for sent in range(rounds + 1):  # the last round only checks what the one before sent
            version = await settled_version(links, i)
            if links.state(i) != CATCHING_UP:
                return
            if version == await newest():
                links.serve(i, version)
                return
            peers = [j for j in links.members(ACTIVE) if j not in failed]
            if not peers or sent == rounds:
                break
            if not await _send_from(links, peers[0], i, asked, timeout_s):
                if links.state(i) == DROPPED:
                    return
                failed.add(peers[0])
    except (SidecarError, TimeoutError) as e:  # the newcomer itself failed or went
        log.warning("sidecar %s could not be caught up: %s", links.url(i), e)
    finally:
        asked.set()
    if links.state(i) == CATCHING_UP:
        links.wait_for_push(i, "was not caught up from a peer", logging.WARNING)


async def _send_from(links: SidecarSet, j: int, i: int, asked: asyncio.Event, timeout_s: float) -> bool:
    """Sidecar j sends sidecar i its newest committed weights; False if that failed."""
    try:
        call_id, q = await links.send(j, P.SendWeights, to=links.url(i), timeout_s=timeout_s)
        asked.set()
        out = await links.reply(j, call_id, q, "send_weights", timeout_s + 60)
    except (SidecarError, TimeoutError) as e:
        if links.state(i) != DROPPED:
            log.warning("catching %s up from %s failed: %s", links.url(i), links.url(j), e)
        return False
    log.info("%s sent sidecar %s version %d (%s, %.1f s)", links.url(j), links.url(i), out["version"], out["from"],
             out["seconds"])
    return True


async def settled_version(links: SidecarSet, i: int, timeout_s: float = 600.0) -> int:
    """Sidecar i's version once no push is under way into it."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        h = await links.call(i, P.Health, "health", 30)
        if not h["pushing"] or asyncio.get_running_loop().time() > deadline:
            return h["version"]
        await asyncio.sleep(0.5)
