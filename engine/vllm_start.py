"""How a vLLM engine starts (for engine/vllm_engine.py): the environment vLLM reads, its engine
arguments from our EngineConfig, the device its processes see, and its core process as the
sidecar handles an engine's `proc`. Nothing here imports vLLM until an engine starts."""

from __future__ import annotations

import os
import threading

from engine.config import EngineConfig

_SPAWN_LOCK = threading.Lock()  # CUDA_VISIBLE_DEVICES is process-wide while a core is spawned


def cpu_env_defaults(tensor_parallel_size: int = 1, cpus: list[int] | None = None) -> dict[str, str]:
    """vLLM-CPU settings that start on this machine: compute on every CPU this process may use
    (vLLM keeps one for its front end by default), one group of them per tensor-parallel rank,
    and a 1 GiB KV cache (once that is set, vLLM skips its free-memory check at start)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if len(cpus) >= tensor_parallel_size:
        per = len(cpus) // tensor_parallel_size
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cpus[r * per:(r + 1) * per])) for r in range(tensor_parallel_size))
    return env


WORKER_EXIT_S = 15


def apply_env_defaults(device: str, tensor_parallel_size: int, log_level: str) -> dict[str, str]:
    """Set the vLLM variables the user did not set; returns those it set. vLLM logs to stderr
    (a sidecar's stdout carries its READY line to whoever started it)."""
    wanted = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_LEVEL": log_level.upper(),
              # its workers' time to exit before their core terminates them: 5 s by default, which loaded
              # CPU cores overran (a terminated worker leaves its shared memory to the resource tracker)
              "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(WORKER_EXIT_S)}
    if device == "cpu":
        wanted.update(cpu_env_defaults(tensor_parallel_size))
    applied = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(applied)
    return applied


def cpu_bind_error(tensor_parallel_size: int) -> str | None:
    """vLLM-CPU wants one CPU group per tensor-parallel rank in VLLM_CPU_OMP_THREADS_BIND (groups
    split by "|"); a mismatch (often a value inherited from a parent set up for one rank) kills
    its core at start with an assertion. Say so before starting anything."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind in ("auto", "nobind") or len(bind.split("|")) == tensor_parallel_size:
        return None
    return (f"VLLM_CPU_OMP_THREADS_BIND={bind!r} names {len(bind.split('|'))} CPU group(s) but "
            f"--tensor-parallel-size {tensor_parallel_size} needs one per rank, split by '|' (e.g. '0|1'); "
            "unset it to let the sidecar split this process's CPUs")


class CoreProcess:
    """vLLM's engine-core process with the Popen calls the sidecar makes on an engine's `proc`."""

    def __init__(self, process):
        self._p = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self._p.exitcode

    def kill(self) -> None:
        if self._p.exitcode is None:
            self._p.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self._p.join(timeout)
        return self._p.exitcode


def import_vllm() -> None:
    """Import what an engine start needs, once, in this thread: transformers' and vLLM's lazy
    imports are not thread-safe, and engines start in threads (in parallel, or a restart)."""
    from transformers import AutoTokenizer  # noqa: F401
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    from vllm.inputs.engine import tokens_input  # noqa: F401
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

    current_platform.is_cpu()  # resolves the platform


def engine_args(cfg: EngineConfig, tensor_parallel_size: int, on_cpu: bool):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=cfg.model, tokenizer=cfg.tokenizer, dtype=cfg.dtype, seed=cfg.seed,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, gpu_memory_utilization=cfg.gpu_memory_utilization,
        enable_prefix_caching=cfg.enable_prefix_caching, max_logprobs=cfg.max_logprobs,
        logprobs_mode="processed_logprobs" if cfg.logprobs_mode == "processed" else "raw_logprobs",
        # CPU: torch.compile costs minutes
        tensor_parallel_size=tensor_parallel_size, enforce_eager=on_cpu or cfg.enforce_eager,
        disable_log_stats=True,
        # vLLM's own fp32 head (its hf_overrides key; absent: its default, the model's dtype on CPU)
        **({"hf_overrides": {"head_dtype": "float32"}} if cfg.head_dtype == "float32" else {}),
        # one cache of every layer asked for (absent: vLLM's own choice, its hybrid manager where it runs it)
        **({"disable_hybrid_kv_cache_manager": True} if cfg.disable_hybrid_kv_cache_manager else {}),
        # our weight receiver in every worker (weight_sync/vllm/extension.py); vLLM takes dotted names
        worker_extension_cls=(cfg.worker_extension_cls or "").replace(":", "."),
    )


def start_vllm(cfg: EngineConfig, tensor_parallel_size: int, on_cpu: bool):
    """AsyncLLM on cfg.device: "cuda:k" spawns its core with only GPU k visible."""
    from vllm.v1.engine.async_llm import AsyncLLM

    args = engine_args(cfg, tensor_parallel_size, on_cpu)
    if not cfg.device.startswith("cuda:"):
        return AsyncLLM.from_engine_args(args)
    with _SPAWN_LOCK:
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.device.split(":", 1)[1]
        try:
            return AsyncLLM.from_engine_args(args)
        finally:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before
