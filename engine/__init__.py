"""The inference engine: continuous batching of HF causal LMs on an engine-owned paged KV cache."""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineGenerateError, EngineUnhealthyError
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineConfig", "EngineDeadError", "EngineGenerateError", "EngineUnhealthyError", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
