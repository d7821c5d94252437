"""Offline, blocking generation: `LLM(cfg).generate(prompts, sampling_params)`."""

from __future__ import annotations

import contextlib
import gc
import itertools

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.inputs import is_conversation, is_single_prompt, tokenize_prompt
from engine.outputs import RequestOutput
from engine.output_processor import RequestState
from engine.sampling_params import SamplingParams


@contextlib.contextmanager
def _heap_frozen():
    """What existed before the call (the model, the engine, the caller's objects) out of the cyclic
    collector's sight while it runs, as vLLM's engine core freezes its start-up heap (so does ours:
    engine/core_proc.py): full collections over the whole heap took ~5% of a SmolLM2 rollout's time, on
    the thread that steps. Unfrozen at the end, so an engine dropped later is collected as before; left
    alone where the process froze its heap itself."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LLM:
    def __init__(self, cfg: EngineConfig | str, **kwargs):
        if isinstance(cfg, str):
            cfg = EngineConfig(model=cfg, **kwargs)
        self.cfg = cfg
        self.core = EngineCore(cfg)
        self.tokenizer = self.core.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. A bad prompt or bad
        parameters raise ValueError before anything runs."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        states: dict[str, RequestState] = {}
        for prompt, p in zip(prompts, params):
            text, ids = tokenize_prompt(prompt, self.tokenizer)
            self.core.validate_prompt(ids)
            rid = f"llm-{next(self._ids)}"
            states[rid] = RequestState(rid, text, ids, p, self.tokenizer)
        for rid, st in states.items():
            self.core.add_request(rid, st.prompt_token_ids, st.params)
        total = sum(p.n for p in params)
        with _heap_frozen(), tqdm(total=total, desc="generate", unit="seq", disable=not use_tqdm) as bar:
            while self.core.has_unfinished():
                for d in self.core.step():
                    states[d.request_id].apply(d)
                    if d.finish_reason is not None:
                        bar.update(1)
        return [st.make_output(self.tokenizer) for st in states.values()]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list
        of them, each rendered by the tokenizer's chat template with the generation prompt."""
        conversations = [messages] if is_conversation(messages) else list(messages)
        if not conversations or not all(is_conversation(c) for c in conversations):
            raise ValueError("chat takes a conversation (a list of {'role', 'content'} messages) or a list of them")
        return self.generate(conversations, sampling_params, use_tqdm)
