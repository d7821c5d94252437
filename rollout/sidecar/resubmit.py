"""A sample cut short goes on from its tokens so far: the one place where a cut rollout is
resubmitted, for whole groups (rollout.sidecar.manager) and streamed ones (rollout.sidecar.group_stream).

A sample is cut by an `abort` pause (its engine request ends with finish_reason "abort") or by its
engine's death (EngineDeadError, with the output so far). It goes on as a request of its own,
prompt + its tokens so far (continuation_params), on the least loaded live engine, until it ends
for real. That engine sees only the continuation's text, so a stop string that straddles a cut is
searched for here, over the whole completion, and the sample is cut at it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from engine import SamplingParams
from engine.errors import EngineDeadError
from engine.stop_checker import first_stop_string
from rollout.sidecar.supervision import NoEngineError


def continuation_params(params: SamplingParams, done: int, attempt: int, index: int, **overrides) -> SamplingParams:
    """The params that go on with sample `index` of a request after it was cut with `done` tokens
    (its `attempt`-th resubmission): one sample, the tokens left, a seed of its own per attempt."""
    left = None if params.max_tokens is None else params.max_tokens - done
    # wrapped into int64, the range a seed may take
    seed = None if params.seed is None else (params.seed + 7919 * attempt + index + 2**63) % 2**64 - 2**63
    return replace(params, n=1, max_tokens=left, min_tokens=max(0, params.min_tokens - done), seed=seed, **overrides)


def head(c, k: int):
    """Completion output `c` cut to its first k tokens."""
    top = None if c.top_logprobs is None else c.top_logprobs[:k]
    return replace(c, token_ids=c.token_ids[:k], logprobs=c.logprobs[:k], weight_versions=c.weight_versions[:k],
                   top_logprobs=top)


def tail(c, k: int):
    """Completion output `c` without its first k tokens."""
    top = None if c.top_logprobs is None else c.top_logprobs[k:]
    return replace(c, token_ids=c.token_ids[k:], logprobs=c.logprobs[k:], weight_versions=c.weight_versions[k:],
                   top_logprobs=top)


@dataclass
class Piece:
    """New tokens of the sample (`output`, a CompletionOutput), and `finish` ("stop" | "length")
    on its last piece. `request`: the engine's RequestOutput it came in (None after a death).
    `keep`: set when a stop string straddles a cut, the sample's length up to it (it may start in
    tokens taken before: a whole group drops those, a stream cannot take them back)."""

    output: object
    finish: str | None
    request: object = None
    keep: int | None = None


async def go_on(manager, prompt_ids: list[int], params: SamplingParams, index: int, tokens: list[int], kind: str,
                extra: Callable[[], dict] = dict) -> AsyncIterator[Piece]:
    """Sample `index`, cut after `tokens`, from there until it ends for real: its new tokens as
    Pieces, each resubmission counted on the manager's state. `kind`: the requests' output_kind
    ("delta", or "final": one piece per request); `extra()`: more overrides of each request's
    params, asked at each resubmission."""
    so_far = list(tokens)
    attempt = 0
    while True:
        attempt += 1
        manager.state.count("aborted_resubmitted")
        routes = {}
        if params.return_routed_experts:  # from the last token so far: it was never an input before the cut
            routes["routed_experts_prompt_start"] = max(params.routed_experts_prompt_start,
                                                        len(prompt_ids) + len(so_far) - 1)
        cont = continuation_params(params, len(so_far), attempt, index, output_kind=kind, **routes, **extra())
        got, finish = 0, None  # tokens this request handed out; how it ended
        try:
            async for ro in manager._stream(prompt_ids + so_far, cont):
                c = ro.outputs[0]
                hit = None
                if params.stop and c.token_ids and c.finish_reason != "abort":
                    hit = first_stop_string(so_far + c.token_ids, params.stop, manager.tokenizer, len(so_far))
                if hit is not None:
                    yield Piece(replace(head(c, max(0, hit[0] - len(so_far))), stop_reason=hit[1]), "stop", ro,
                                keep=hit[0])
                    return
                so_far += c.token_ids
                got += len(c.token_ids)
                finish = c.finish_reason if c.finish_reason != "abort" else None
                yield Piece(c, finish, ro)
                if c.finish_reason is not None:  # ended for real, or cut again (then resubmitted)
                    break
        except NoEngineError:
            raise
        except EngineDeadError as e:  # its engine died: on from the tokens so far, elsewhere
            manager.state.count("resubmitted_after_engine_death")
            partial = getattr(e, "partial", None)
            if partial is not None and len(partial.outputs[0].token_ids) > got:  # what it had not handed out
                rest = replace(tail(partial.outputs[0], got), finish_reason=None)
                so_far += rest.token_ids
                yield Piece(rest, None)
            continue
        if finish is not None:
            return
