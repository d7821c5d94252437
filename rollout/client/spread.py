"""One `generate_iter` call's prompts spread over the active sidecars (rollout.client.sidecar_set), and
re-sent to the others when one goes. Prompts of a named session go where the client's placement
(rollout.client.placement) puts that session; the others in contiguous parts, one a sidecar."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from engine.sampling_params import SamplingParams
from rollout.common import protocol as P
from rollout.client.sidecar_link import ACTIVE, SidecarError, SidecarGoneError
from rollout.client.placement import Placement
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


def session_list(sessions, n_prompts: int) -> list[str | None] | None:
    """generate_iter's `sessions` as one session (or None) a prompt: None, one name for every prompt, or
    a list of one name (or None) a prompt."""
    if sessions is None or isinstance(sessions, str):
        return None if sessions is None else [sessions] * n_prompts
    sessions = list(sessions)
    if len(sessions) != n_prompts or not all(s is None or isinstance(s, str) for s in sessions):
        raise ValueError(f"sessions must be a name, or one name (or None) for each of the {n_prompts} prompts")
    return sessions


def _chunks(indices: list[int], k: int) -> list[list[int]]:
    """`indices` cut into k contiguous parts of near-equal size (some empty when fewer than k)."""
    n = len(indices)
    return [indices[n * j // k:n * (j + 1) // k] for j in range(k)]


class Spread:
    """One generate_iter call's prompts spread over the sidecars: which call carries which
    prompts, and one queue into which a pump per call forwards its answers (or its error)."""

    def __init__(self, links: SidecarSet, prompts: list, wire, sessions: list[str | None] | None = None,
                 placement: Placement | None = None):
        self.links, self.prompts, self.wire = links, prompts, wire
        self.sessions = sessions
        self.placement = placement or Placement()
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
            for i, part in self._parts(indices, serving).items():
                if part and not await self._send(i, part):
                    self.placement.done(i, len(part))
                    left += part
            indices = left

    def _parts(self, indices: list[int], serving: list[int]) -> dict[int, list[int]]:
        """Each serving sidecar's prompts of `indices`: a named session's where the placement puts it, the
        others cut into contiguous parts, the first (and larger) parts to the least busy; all counted busy
        there."""
        named = [x for x in indices if self.sessions is not None and self.sessions[x] is not None]
        taken = set(named)
        free = [x for x in indices if x not in taken]
        by_load = self.placement.least_busy_first(serving)  # a one-prompt call to the least busy, not the first
        parts = dict(zip(by_load, sorted(_chunks(free, len(serving)), key=len, reverse=True)))
        for i, part in parts.items():
            self.placement.sent(i, len(part))
        if named:
            for x, i in zip(named, self.placement.place([self.sessions[x] for x in named], serving)):
                parts[i].append(x)
        return parts

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
        self.placement.done(i)
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
            self.placement.done(i, len(rest))
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
        for (i, cid), part in list(self.calls.items()):
            self.placement.done(i, sum(1 for x in part if x not in self.done))
            await self.links.give_up(i, cid)
        for i, cid in self._sent:
            self.links.forget(i, cid)
