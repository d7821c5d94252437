"""The one place where our request types meet vLLM's (for engine/vllm_engine.py).

- `to_vllm_params`: our SamplingParams as vLLM's. vLLM streams deltas to the adapter
  (RequestOutputKind.DELTA), except for a request that wants its output only when it finishes
  (ours "final": the rollout manager's every request), which vLLM then gathers itself and sends
  once (FINAL_ONLY, as its own `LLM.generate` asks): a RequestOutput per token per sample less
  on the sidecar's cores. It always returns the sampled token's logprob (logprobs=0 at least):
  `.logprobs` is one float per token.
  A parameter vLLM lacks, or cannot honour where it runs, is a ValueError naming it.
- `completion_deltas`: one vLLM CompletionOutput delta as our SeqDeltas (engine.messages), which
  engine.output_processor.RequestState gathers exactly as it does our own core's: one delta per
  run of tokens sampled under one weight version.

Versions come from vLLM's engine core, which stamps every step's outputs with the version it
holds at that step (`AsyncLLM.update_weight_version`), so a token sampled before a pause keeps
its version however late the frontend reads it. Those stamps reach us as spans: the request's
(version, first token index) pairs (`version_spans`).
"""

from __future__ import annotations

from dataclasses import fields, replace

from engine.messages import SeqDelta, TokenLogprobs
from engine.sampling_params import SamplingParams

# ours -> vLLM's, same name and meaning
_SAME = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
         "frequency_penalty", "max_tokens", "min_tokens", "ignore_eos", "seed", "prompt_logprobs",
         "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "bad_words")
_OURS_ONLY = ("output_kind", "detokenize", "stop", "stop_token_ids", "logprobs")  # mapped by hand below
INITIAL_VERSION = 0  # vLLM's core says "default" until a version is set: the checkpoint's, ours 0


class SeedRefused(ValueError):
    """A per-request seed on vLLM's CPU build (it kills the engine core there)."""


def to_vllm_params(params: SamplingParams, on_cpu: bool):
    """vLLM's SamplingParams for ours; ValueError naming what vLLM cannot take."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind

    if on_cpu and params.seed is not None:
        raise SeedRefused("seed: vLLM's CPU build cannot take a per-request seed (its worker fails with 'CPU "
                          "Generator does not use offset' and the engine core dies); send the request without one, "
                          "or use --engine native")
    vllm_fields = set(VllmParams.__struct_fields__)
    defaults = SamplingParams()
    for f in fields(SamplingParams):
        if f.name not in _SAME and f.name not in _OURS_ONLY and getattr(params, f.name) != getattr(defaults, f.name):
            raise ValueError(f"{f.name}: not a sampling parameter the vLLM engine takes")
    missing = [name for name in _SAME if name not in vllm_fields]
    used = [name for name in missing if getattr(params, name) != getattr(defaults, name)]
    if used:
        raise ValueError(f"{used[0]}: this vLLM version has no such sampling parameter")
    return VllmParams(
        **{name: getattr(params, name) for name in _SAME if name not in missing},
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        logprobs=0 if params.logprobs is None else params.logprobs,  # the sampled token's, always
        output_kind=RequestOutputKind.FINAL_ONLY if params.output_kind == "final" else RequestOutputKind.DELTA,
        detokenize=params.detokenize or bool(params.stop),  # vLLM finds stop strings in its own text
    )


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """One request's params per sample (the adapter sends each sample as a vLLM request of its
    own): a seed of its own each (vLLM's children take seed + index too), the prompt's logprobs
    asked of the first only."""
    out = []
    for i in range(params.n):
        seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63  # wrapped into int64
        out.append(replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if i == 0 else None))
    return out


def parse_version(label: str | None) -> int | None:
    if label is None:
        return None
    try:
        return int(label)
    except ValueError:
        return INITIAL_VERSION


def version_spans(completion, request_state) -> list[tuple[int, int]]:
    """(first token index, version) of each run of a completion's tokens: from the finished
    output's spans, else from vLLM's output processor's state of the running request."""
    if completion.weight_versions:
        return [(s.start, parse_version(s.version)) for s in completion.weight_versions]
    if request_state is None:
        return []
    return [(start, parse_version(v)) for v, start in list(request_state.weight_version_starts)]


def token_versions(spans: list[tuple[int, int]], start: int, count: int, fallback: int) -> list[int]:
    """The version of tokens start .. start + count - 1 (`fallback` before the first span)."""
    out = []
    j, version = 0, fallback
    for p in range(start, start + count):
        while j < len(spans) and spans[j][0] <= p:
            version = spans[j][1]
            j += 1
        out.append(version)
    return out


def _position(entry) -> TokenLogprobs:
    return {int(t): (float(lp.logprob), lp.rank) for t, lp in entry.items()}


def prompt_logprobs_of(request_output) -> list[TokenLogprobs | None] | None:
    pl = request_output.prompt_logprobs
    if not pl:
        return None
    return [None if e is None else _position(e) for e in pl]


def completion_deltas(request_id: str, c, versions: list[int], want_top: bool) -> list[SeqDelta]:
    """vLLM completion delta `c` (its new tokens tagged `versions`) as SeqDeltas, one per run
    of one version; the finish reason goes on the last."""
    positions = list(c.logprobs or ())
    if len(positions) != len(c.token_ids):
        raise RuntimeError(f"vLLM returned {len(positions)} logprobs for {len(c.token_ids)} tokens")
    logprobs = [float(pos[t].logprob) for t, pos in zip(c.token_ids, positions)]
    top = [_position(pos) for pos in positions] if want_top else None
    deltas, start = [], 0
    for end in range(1, len(versions) + 1):
        if end == len(versions) or versions[end] != versions[start]:
            deltas.append(SeqDelta(request_id, c.index, list(c.token_ids[start:end]), logprobs[start:end],
                                   versions[start], top_logprobs=None if top is None else top[start:end]))
            start = end
    if not deltas:
        deltas.append(SeqDelta(request_id, c.index, [], [], INITIAL_VERSION, top_logprobs=[] if want_top else None))
    if c.finish_reason is not None:
        deltas[-1].finish_reason, deltas[-1].stop_reason = str(c.finish_reason), c.stop_reason
    return deltas
