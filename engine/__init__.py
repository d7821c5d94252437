"""The inference engine: continuous batching of HF causal LMs on an engine-owned paged KV cache."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
