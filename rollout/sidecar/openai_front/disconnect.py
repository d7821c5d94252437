"""A front-end request's work, cancelled when its HTTP client goes away: shared by the OpenAI routes
(rollout/sidecar/openai_front/app.py) and SGLang's (sglang_routes.py)."""

from __future__ import annotations

import logging

from fastapi import HTTPException, Request

from rollout.common.caller_gone import CallerGone, unless_caller_goes
from rollout.sidecar.group_stream import ShuttingDown
from rollout.sidecar.supervision import NoEngineError

log = logging.getLogger(__name__)


async def until_disconnected(request: Request, work):
    """Awaits `work`; a client that goes away meanwhile cancels it (its engine requests abort),
    as vLLM does. No engine at all is a 503."""
    try:
        return await unless_caller_goes(request, work)
    except CallerGone:
        log.info("client of %s went away: its request is aborted", request.url.path)
        raise HTTPException(499, detail={"message": "client disconnected"}) from None
    except (NoEngineError, ShuttingDown) as e:
        raise HTTPException(503, detail={"message": str(e)}) from e
