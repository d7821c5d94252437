"""Gathers the core's per-step deltas into RequestOutputs (one per request, n completions)."""

from __future__ import annotations

import numpy as np

from engine.messages import RoutedRows, SeqDelta, TokenLogprobs
from engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stop_checker import truncate_at_stop


def position_logprobs(entry: TokenLogprobs | None, tokenizer) -> PositionLogprobs | None:
    """One position's {id: (logprob, rank)} from the core as vLLM's {id: Logprob}; each token's
    text alone when a tokenizer is given."""
    if entry is None:
        return None
    return {t: Logprob(lp, rank, None if tokenizer is None else tokenizer.decode([t])) for t, (lp, rank) in entry.items()}


def _add_routed(out: CompletionOutput, rows: RoutedRows, version: int) -> None:
    """Append a step's routed-expert rows (computed under `version`) to the completion's."""
    new = np.frombuffer(rows.data, dtype=rows.dtype).reshape(-1, rows.layers, rows.k)
    out.routed_experts = new if out.routed_experts is None else np.concatenate([out.routed_experts, new])
    out.routed_experts_versions = (out.routed_experts_versions or []) + [version] * len(new)


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer=None):
        self.request_id = request_id
        self.tokenizer = tokenizer if params.detokenize else None  # for Logprob.decoded_token
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.outputs = [CompletionOutput(i, "", [], [], None, None, []) for i in range(params.n)]
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        if params.logprobs is not None:
            for o in self.outputs:
                o.top_logprobs = []
        self.sent = [0] * params.n  # tokens already handed out, per completion (delta streaming)
        self.sent_routed = [0] * params.n  # routed-expert rows likewise

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def abort(self) -> None:
        """Finish every completion still running as aborted (the frontend's abort is final)."""
        for o in self.outputs:
            if o.finish_reason is None:
                o.finish_reason = "abort"

    def apply(self, d: SeqDelta) -> None:
        out = self.outputs[d.index]
        if out.finish_reason is not None:  # finished here already (an abort): later deltas are void
            return
        out.token_ids += d.token_ids
        out.logprobs += d.logprobs
        out.weight_versions += [d.version] * len(d.token_ids)
        if d.top_logprobs is not None and out.top_logprobs is not None:
            out.top_logprobs += [position_logprobs(e, self.tokenizer) for e in d.top_logprobs]
        if d.routed_experts is not None:
            _add_routed(out, d.routed_experts, d.version)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = [position_logprobs(e, self.tokenizer) for e in d.prompt_logprobs]
        if d.finish_reason is not None:
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        if d.num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)

    def make_output(self, tokenizer, delta: bool = False) -> RequestOutput:
        """Cumulative output so far, or (delta=True) only what was not handed out before."""
        outs = []
        for i, o in enumerate(self.outputs):
            start = self.sent[i] if delta else 0
            text = ""
            if self.params.detokenize:
                text = tokenizer.decode(o.token_ids, skip_special_tokens=True)
                if o.finish_reason is not None:
                    text = truncate_at_stop(text, o.stop_reason, self.params.include_stop_str_in_output)
                if delta:  # text deltas: the new tail of the decoded text
                    text = text[len(tokenizer.decode(o.token_ids[:start], skip_special_tokens=True)) :]
            top = None if o.top_logprobs is None else o.top_logprobs[start:]
            outs.append(
                CompletionOutput(
                    o.index, text, o.token_ids[start:], o.logprobs[start:], o.finish_reason, o.stop_reason,
                    o.weight_versions[start:], top,
                )
            )
            self.sent[i] = len(o.token_ids)
            if o.routed_experts is not None:
                first = self.sent_routed[i] if delta else 0
                outs[-1].routed_experts = o.routed_experts[first:]
                outs[-1].routed_experts_versions = o.routed_experts_versions[first:]
                self.sent_routed[i] = len(o.routed_experts)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished, self.num_cached_tokens,
            self.prompt_logprobs,
        )
