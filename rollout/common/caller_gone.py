"""An HTTP request's work, cancelled when its caller goes away: the sidecar's front (its engine requests
abort: rollout/sidecar/openai_front/disconnect.py) and the router (its call to a sidecar closes, and that
sidecar aborts: rollout/router/forward.py) both wait this way."""

from __future__ import annotations

import asyncio


class CallerGone(Exception):
    """The caller closed its connection before its answer came."""


async def unless_caller_goes(request, work):
    """Awaits `work`; a caller (a Starlette request) that goes away meanwhile cancels it and raises CallerGone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise CallerGone
    finally:
        if not task.done():
            task.cancel()
