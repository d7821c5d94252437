"""From prompt ids and SamplingParams to the choices of one HTTP request: every prompt's group
streamed through the manager (rollout.sidecar.group_stream), interleaved, each choice with its text
decoded as it grows. The endpoints only format what comes out of here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine import SamplingParams
from engine.outputs import PositionLogprobs
from rollout.sidecar.group_stream import SampleDelta, stream_group
from rollout.sidecar.openai_front.detokenize import IncrementalText


@dataclass
class Choice:
    """One choice as it accumulates (a prompt's sample; index = prompt * n + sample)."""

    index: int
    prompt_ids: list[int]
    text: IncrementalText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    top_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # when params.prompt_logprobs is set
    finish_reason: str | None = None
    routed: list = field(default_factory=list)  # return_routed_experts: the rows so far, in pieces

    def add(self, d: SampleDelta) -> str:
        """Takes a delta in; returns the text it adds."""
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.weight_versions += d.weight_versions
        if d.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + d.top_logprobs
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.routed_experts is not None:
            self.routed.append(d.routed_experts)
        self.finish_reason = d.finish_reason
        return self.text.add(d.token_ids, d.finish_reason is not None, d.stop_reason)


async def choice_deltas(manager, prompts: list[list[int]], params: SamplingParams, stream: bool = True
                        ) -> AsyncIterator[tuple[Choice, SampleDelta, str]]:
    """(its choice, the delta, the new text) for every delta of every prompt's group, as they
    come. Leaving early (a client gone) stops every engine request of the request."""
    choices = [Choice(p * params.n + i, ids, IncrementalText(manager.tokenizer, params.stop,
                                                              params.include_stop_str_in_output))
               for p, ids in enumerate(prompts) for i in range(params.n)]
    if len(prompts) == 1:  # the usual case: no merging
        async for d in stream_group(manager, prompts[0], params, stream):
            c = choices[d.index]
            yield c, d, c.add(d)
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, ids: list[int]) -> None:
        try:
            async for d in stream_group(manager, ids, params, stream):
                await merged.put((p, d))
        except Exception as e:  # noqa: BLE001 - reaches the request
            await merged.put((p, e))
        await merged.put((p, None))

    pumps = [asyncio.ensure_future(pump(p, ids)) for p, ids in enumerate(prompts)]
    try:
        left = len(prompts)
        while left:
            p, d = await merged.get()
            if d is None:
                left -= 1
            elif isinstance(d, Exception):
                raise d
            else:
                c = choices[p * params.n + d.index]
                yield c, d, c.add(d)
    finally:
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def whole_choices(manager, prompts: list[list[int]], params: SamplingParams) -> list[Choice]:
    """Every choice, finished, in index order (a request that does not stream)."""
    out: dict[int, Choice] = {}
    async for c, _, _ in choice_deltas(manager, prompts, params, stream=False):
        out[c.index] = c
    return [out[i] for i in sorted(out)]


def routed_experts_b64(c: Choice) -> str | None:
    """The choice's routed experts as vLLM's and SGLang's servers return them: a base64 string of
    the array's `.npy` bytes ([positions, layers, k]; numpy.load reads it); None when not asked."""
    if not c.routed:
        return None
    import base64
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.concatenate(c.routed), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")
