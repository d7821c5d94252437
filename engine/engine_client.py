"""EngineClient: what the rollout side uses of an engine (vLLM's `EngineClient` protocol). Two
classes meet it, neither by inheriting: engine.AsyncEngine (ours) and engine.vllm_engine.VllmEngine
(vLLM's AsyncLLM behind our surface). A caller typed against it works with either."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from engine.messages import PauseMode

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams


@runtime_checkable
class EngineProcess(Protocol):
    """An engine's core process, as far as a supervisor reaches it (subprocess.Popen's names)."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


@runtime_checkable
class EngineClient(Protocol):
    cfg: EngineConfig
    tokenizer: Any  # the model's HF tokenizer
    vocab_size: int
    num_workers: int  # the ranks this engine brings to a weight-sync group
    proc: EngineProcess
    dead_reason: str  # why it died, once `errored`
    # True: its prefix cache keys each block by the weight version its KV was computed under, so a
    # push's commit leaves the cache as it is (engine/block_manager.py); False: a commit resets it
    prefix_cache_keyed_by_version: bool

    @property
    def errored(self) -> bool:
        """The engine is gone (died or shut down): nothing it was asked will complete."""

    def generate(self, prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """One request's outputs as they come; leaving early aborts it."""

    async def abort(self, request_id: str | list[str]) -> None: ...

    async def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None: ...

    async def resume_generation(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """`method` on every worker; one result per worker."""

    async def set_weight_version(self, version: int) -> int: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self) -> None: ...

    async def check_health(self, timeout: float = 30.0) -> dict: ...

    async def get_stats(self) -> dict: ...

    def shutdown(self, timeout: float = 5.0) -> None: ...
