"""The n samples of one prompt, streamed as they are generated (the HTTP front's path; the ZMQ
path returns whole groups through `RolloutManager.generate_group`).

The same promise as a whole group: a sample cut short by an `abort` pause or by its engine's
death goes on from its tokens so far on a live engine, and its stream simply continues; the
deltas of a sample, joined, are the whole sample, with the weight version of every token. The
resubmission is rollout.sidecar.resubmit's, as for whole groups. What a stream cannot do is take back
tokens it already handed out: streamed samples are not regenerated for `max_staleness` (their
versions tell the trainer how stale they are).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from engine import SamplingParams
from engine.errors import EngineDeadError
from rollout.sidecar.resubmit import go_on, tail
from rollout.sidecar.supervision import NoEngineError


class ShuttingDown(RuntimeError):
    """The sidecar is shutting down: a streamed group ends here (end_streams)."""


def end_streams(manager, reason: str) -> None:
    """Ends every streamed group now with ShuttingDown (their engine requests are aborted)."""
    for q in list(manager.state.streams):
        q.put_nowait(ShuttingDown(reason))


@dataclass
class SampleDelta:
    """New tokens of sample `index` (possibly none, when it only finishes)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" on the sample's last delta
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None  # with params.prompt_logprobs: the prompt's, on every delta once known
    routed_experts: object = None  # with params.return_routed_experts: the rows these tokens' step(s) added


@dataclass
class _Progress:
    token_ids: list[int] = field(default_factory=list)
    done: bool = False


async def stream_group(manager, prompt_ids: list[int], params: SamplingParams, stream: bool = True
                       ) -> AsyncIterator[SampleDelta]:
    """Deltas of the n samples, interleaved as the engines produce them; each sample ends with
    exactly one delta whose finish_reason is set. Leaving early aborts every engine request.
    `stream=False`: each engine request answers once, at its end (fewer, larger deltas). The
    engines do not decode text here: the caller does, once per delta."""
    group = _GroupStream(manager, prompt_ids, params, "delta" if stream else "final")
    state = manager.state
    state.streams.add(group.out)
    group.spawn(group.first())
    finished = 0  # samples whose last delta was handed out
    try:
        with state.in_flight("groups_in_flight"):
            while finished < params.n:
                item = await group.out.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    if not group.tasks and group.out.empty():
                        raise RuntimeError("a sample's stream ended without finishing")  # a bug, not a hang
                    continue
                if item.finish_reason:
                    finished += 1
                    state.count("rollouts")
                state.count("generated_tokens", len(item.token_ids))
                yield item
    finally:
        state.streams.discard(group.out)
        await group.cancel()


class _GroupStream:
    """The engine requests behind one streamed group: the first (all n samples), then one per
    cut sample, each putting SampleDeltas (or its error, or None as a wake-up when it ends) on
    `out`."""

    def __init__(self, manager, prompt_ids: list[int], params: SamplingParams, kind: str):
        self.manager, self.prompt_ids, self.params, self.kind = manager, prompt_ids, params, kind
        self.out: asyncio.Queue = asyncio.Queue()
        self.samples = [_Progress() for _ in range(params.n)]
        self.tasks: set[asyncio.Task] = set()
        self.prompt_logprobs = None

    def note_prompt_logprobs(self, ro) -> None:
        """The prompt's logprobs, from whichever engine request computed them first (a resubmitted
        sample's prompt holds its tokens so far too: only the prompt's part)."""
        if self.prompt_logprobs is None and ro.prompt_logprobs is not None:
            self.prompt_logprobs = ro.prompt_logprobs[:len(self.prompt_ids)]

    def spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self._ended)

    def _ended(self, t: asyncio.Task) -> None:
        self.tasks.discard(t)
        self.out.put_nowait(None if t.cancelled() else t.exception())  # None: just a wake-up

    async def cancel(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def emit(self, i: int, c, finish: str | None) -> None:
        s = self.samples[i]
        s.token_ids += c.token_ids
        s.done = finish is not None
        self.out.put_nowait(SampleDelta(i, c.token_ids, c.logprobs, c.weight_versions, c.top_logprobs, finish,
                                        c.stop_reason if finish else None, self.prompt_logprobs,
                                        getattr(c, "routed_experts", None)))

    async def first(self) -> None:
        m, cut = self.manager, []
        try:
            params = replace(self.params, output_kind=self.kind, detokenize=False)
            async for ro in m._stream(self.prompt_ids, params):
                self.note_prompt_logprobs(ro)
                for c in ro.outputs:
                    if c.finish_reason == "abort":
                        self.emit(c.index, c, None)
                        cut.append(c.index)
                    elif c.token_ids or c.finish_reason:
                        self.emit(c.index, c, c.finish_reason)
        except NoEngineError:
            raise
        except EngineDeadError as e:  # every sample not finished goes on elsewhere, from its tokens so far
            m.state.count("resubmitted_after_engine_death")
            partial = getattr(e, "partial", None)
            for c in partial.outputs if partial is not None else ():
                if not self.samples[c.index].done:  # the partial is cumulative: only what was not handed out
                    self.emit(c.index, tail(c, len(self.samples[c.index].token_ids)), None)
            cut = [i for i, s in enumerate(self.samples) if not s.done]
        for i in cut:
            self.spawn(self.go_on(i))

    async def go_on(self, i: int) -> None:
        """Sample i from its tokens so far, until it ends for real (rollout.sidecar.resubmit)."""
        def extra() -> dict:  # the prompt's logprobs once known are not asked again
            return {"detokenize": False, **({"prompt_logprobs": None} if self.prompt_logprobs is not None else {})}

        pieces = go_on(self.manager, self.prompt_ids, self.params, i, self.samples[i].token_ids, self.kind, extra)
        async for piece in pieces:
            if piece.request is not None:
                self.note_prompt_logprobs(piece.request)
            self.emit(i, piece.output, piece.finish)
