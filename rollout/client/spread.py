"""One `generate_iter` call's prompts spread over the active sidecars (rollout.client.sidecar_set), and
re-sent to the others when one goes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from engine.sampling_params import SamplingParams
from rollout.common import protocol as P
from rollout.client.sidecar_link import ACTIVE, SidecarError, SidecarGoneError
from rollout.client.sidecar_set import SidecarSet

log = logging.getLogger("rollout.client")


def _params_wire(params, n_prompts: int):
    params = params or SamplingParams()
    if isinstance(params, list):
        if len(params) != n_prompts:
            raise ValueError(f"{len(params)} sampling params for {n_prompts} prompts")
        return [p.to_dict() for p in params]
    return params.to_dict()


def generate_inputs(prompts, sampling_params) -> tuple[list, Any]:
    """generate_iter's prompts as a list (one conversation is one prompt) and their params' wire form."""
    from engine.inputs import is_conversation

    if is_conversation(prompts):  # one conversation, not a list of dict prompts
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty list")
    return prompts, _params_wire(sampling_params, len(prompts))


def _chunks(indices: list[int], k: int) -> list[list[int]]:
    """`indices` cut into k contiguous parts of near-equal size (some empty when fewer than k)."""
    n = len(indices)
    return [indices[n * j // k:n * (j + 1) // k] for j in range(k)]


class Spread:
    """One generate_iter call's prompts spread over the sidecars: which call carries which
    prompts, and one queue into which a pump per call forwards its answers (or its error)."""

    def __init__(self, links: SidecarSet, prompts: list, wire):
        self.links, self.prompts, self.wire = links, prompts, wire
        self.merged: asyncio.Queue = asyncio.Queue()
        self.calls: dict[tuple[int, int], list[int]] = {}  # (sidecar, call id) -> the prompts it carries
        self.done: set[int] = set()
        self._sent: list[tuple[int, int]] = []
        self._pumps: list[asyncio.Task] = []

    async def submit(self, indices: list[int]) -> None:
        """Sends prompts `indices` over the active sidecars; a part whose sidecar is gone goes round again."""
        while indices:
            serving = self.links.members(ACTIVE)
            if not serving:
                raise SidecarError(f"generate: no sidecar left to serve ({self.links.gone_reasons()})", "gone")
            left = []
            for i, part in zip(serving, _chunks(indices, len(serving))):
                if part and not await self._send(i, part):
                    left += part
            indices = left

    async def _send(self, i: int, part: list[int]) -> bool:
        """One Generate call of prompts `part` to sidecar i, with its pump; False if the sidecar is gone."""
        params = [self.wire[x] for x in part] if isinstance(self.wire, list) else self.wire
        try:
            cid, q = await self.links.send(i, P.Generate, prompts=[self.prompts[x] for x in part], params=params)
        except SidecarGoneError:
            return False
        self.calls[(i, cid)] = part
        self._sent.append((i, cid))
        self._pumps.append(asyncio.ensure_future(self._pump(i, cid, q)))
        return True

    async def _pump(self, i: int, cid: int, q: asyncio.Queue) -> None:
        try:
            while True:
                msg = await self.links.next(i, q, "generate")
                await self.merged.put((i, cid, msg))
                if isinstance(msg, P.Reply):
                    return
        except Exception as e:  # a timeout or a dropped sidecar must reach the consumer
            await self.merged.put((i, cid, e))

    def finished(self, i: int, cid: int, index: int) -> int:
        """The prompt index of group `index` of call (i, cid), now done."""
        idx = self.calls[(i, cid)][index]
        self.done.add(idx)
        return idx

    async def call_ended(self, i: int, cid: int, msg) -> None:
        """Call (i, cid) ended: its sidecar went (its unfinished prompts are re-sent), it failed
        (raised here), or it finished (forgotten)."""
        others = [j for j in self.links.members(ACTIVE) if j != i]  # i may be dropped already (its heartbeats)
        if isinstance(msg, P.Reply) and not msg.ok and msg.error_kind == "gone" and others:
            # the sidecar is shutting down or has no engine left: the others take its prompts
            self.links.drop(i, msg.error)
            msg = SidecarGoneError(self.links.url(i), msg.error)
        if isinstance(msg, SidecarGoneError):
            rest = [x for x in self.calls.pop((i, cid)) if x not in self.done]
            log.warning("re-sending %d unfinished prompts of %s to the other sidecars", len(rest), msg.url)
            await self.submit(rest)
        elif isinstance(msg, Exception):
            raise msg
        elif not msg.ok:
            raise SidecarError(f"generate failed on {self.links.url(i)}: {msg.error}", msg.error_kind)
        else:
            del self.calls[(i, cid)]

    async def close(self) -> None:
        """Stops the pumps, tells each sidecar of a call still open that its caller gave up (a
        timeout, a cancelled task, a consumer that stopped reading: the sidecar aborts its
        requests), and forgets the calls' queues."""
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)  # let the cancellations land
        for i, cid in list(self.calls):
            await self.links.give_up(i, cid)
        for i, cid in self._sent:
            self.links.forget(i, cid)
