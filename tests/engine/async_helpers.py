"""Helpers the AsyncEngine tests share (their engine is tests/engine/conftest.py's): reading a
request to its end, and waiting until requests run."""

import asyncio
import time

EXT = "tests.engine.rpc_extension:RpcTestExtension"


async def _collect(engine, prompt, params, rid=None):
    last = None
    async for out in engine.generate(prompt, params, request_id=rid):
        last = out
    return last


async def _wait_for_tokens(engine, ids, n, timeout=60):
    """Until every request in `ids` is running and has at least n tokens."""
    deadline = time.monotonic() + timeout
    while not all(r in engine.requests and len(engine.requests[r].state.outputs[0].token_ids) >= n for r in ids):
        assert time.monotonic() < deadline, "requests did not start"
        await asyncio.sleep(0.005)
