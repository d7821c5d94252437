"""The inference engine: continuous batching of HF causal LMs on an engine-owned paged KV cache.

Names are imported on first use (PEP 562), so `from engine.sampling_params import SamplingParams`
in a trainer's client loads the sampling parameters, not the model runner and the async engine.
"""

import importlib

_WHERE = {
    "AsyncEngine": "engine.async_engine",
    "EngineClient": "engine.engine_client",
    "EngineConfig": "engine.config",
    "EngineDeadError": "engine.errors",
    "EngineGenerateError": "engine.errors",
    "EngineUnhealthyError": "engine.errors",
    "ExactLogprobs": "engine.exact_logprobs",
    "LLM": "engine.llm",
    "PauseMode": "engine.messages",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
