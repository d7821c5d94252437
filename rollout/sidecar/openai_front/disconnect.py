"""A front-end request's work, cancelled when its HTTP client goes away: shared by the OpenAI routes
(rollout/sidecar/openai_front/app.py) and SGLang's (sglang_routes.py)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import HTTPException, Request

from rollout.sidecar.group_stream import ShuttingDown
from rollout.sidecar.supervision import NoEngineError

log = logging.getLogger(__name__)


async def until_disconnected(request: Request, work):
    """Awaits `work`; a client that goes away meanwhile cancels it (its engine requests abort),
    as vLLM does. No engine at all is a 503."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client of %s went away: its request is aborted", request.url.path)
                task.cancel()
                raise HTTPException(499, detail={"message": "client disconnected"})
    except (NoEngineError, ShuttingDown) as e:
        raise HTTPException(503, detail={"message": str(e)})
    finally:
        if not task.done():
            task.cancel()
