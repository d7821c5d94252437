"""What a consumer of `AsyncEngine.generate` waits on (vLLM v1's `RequestOutputCollector`): one
collector per request, and the merge of several requests' streams into one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from engine.messages import RequestError
from engine.output_processor import RequestState


class RequestCollector:
    """One request's accumulated state; `event` wakes its consumer, who reads everything new:
    the core's deltas accumulate in `state` while the consumer is slow."""

    def __init__(self, state: RequestState):
        self.state = state
        self.event = asyncio.Event()
        self.error: RequestError | None = None


async def interleave(streams: list[AsyncIterator]) -> AsyncGenerator:
    """Several streams as one, items in the order they come: each stream runs in its own task
    feeding one queue. The first error of any stream is raised; leaving early (or an error)
    cancels every task, which closes its stream."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def feed(stream):
        try:
            async for out in stream:
                queue.put_nowait(out)
            queue.put_nowait(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, who re-raises it
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(feed(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()  # cancelling a feeder closes its stream (a request's: it aborts the request)
        await asyncio.gather(*tasks, return_exceptions=True)
