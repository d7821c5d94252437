"""Engine configuration (vLLM-style names)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "float16", "bfloat16")  # the engine's dtypes, by torch's names


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype a checkpoint's config.json names (`dtype`, or `torch_dtype` before transformers 5)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return name if name in _DTYPES else None


QUANTIZATIONS = ("none", "int8", "fp8", "auto")


def resolve_quantization(quantization: str, device: str) -> str:
    """The 8-bit copy an engine serves from. "auto" is the one this device runs: int8 on the CPU
    (engine/kernels/int8_linears.py), fp8 on CUDA (engine/kernels/fp8_linears.py; Hopper or newer). int8 on CUDA
    and fp8 on the CPU are refused by name: each has no kernel there."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    cuda = device.startswith("cuda")
    if quantization == "auto":
        return "fp8" if cuda else "int8"
    if quantization == "int8" and cuda:
        raise ValueError("quantization 'int8' runs on the CPU only: on CUDA use 'fp8' (or 'auto')")
    if quantization == "fp8" and not cuda:
        raise ValueError("quantization 'fp8' runs on CUDA only: on the CPU use 'int8' (or 'auto')")
    return quantization


def resolve_dtype(dtype: str, device: str, model_dir: str) -> str:
    """The engine's dtype. "auto" is the checkpoint's own on a GPU (vLLM's rule: a bf16 model
    serves in bf16, half the bytes of float32 per weight, per push and per KV entry) and float32
    on the CPU (whose matmuls run bf16 slower than float32 without AMX)."""
    if dtype == "auto":
        return (checkpoint_dtype(model_dir) or "float32") if device.startswith("cuda") else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return dtype


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to `model`
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto": the checkpoint's dtype on CUDA (bf16 for most), float32 on CPU
    max_num_seqs: int = 64  # sequences in the running batch
    max_model_len: int = 1024  # prompt + completion tokens
    max_num_batched_tokens: int | None = None  # prefill tokens per step; default max(4096, max_model_len)
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int | None = None  # default: room for every running sequence at full length (or its window)
    # layers with and without a window (Gemma 3, Qwen2's upper ones) keep one cache, every layer's keys
    # at full length, instead of a cache per kind (engine/kv_groups.py; vLLM's name)
    disable_hybrid_kv_cache_manager: bool = False
    kv_cache_memory_gb: float = 4.0  # cap on the automatic KV-cache size on CPU
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU's memory this engine may fill (vLLM's name)
    enable_prefix_caching: bool = True
    seed: int = 0  # seeds the shared generator used by requests without their own seed
    max_logprobs: int = 20  # the most top logprobs (and prompt logprobs) a request may ask for (vLLM's name)
    logprobs_mode: str = "processed"  # "processed": from the sampling distribution; "raw": model softmax
    worker_extension_cls: str | None = None  # "pkg.module:Class" (or dotted) mixed into the worker
    num_threads: int | None = None  # torch intra-op threads on CPU; default: the CPUs this process may use
    # LoRA adapter pushes: 0 merges each into the weights; k > 0 keeps up to k versions unmerged,
    # each sequence decoding with the one it started under (engine/lora_bank.py)
    lora_versions: int = 0
    # Llama-shaped models (llama, qwen2, mistral) run their decoder layers as one short function
    # each (engine/models/fused_layers.py: ~50 aten ops a layer instead of ~80); False keeps HF's layers
    fuse_layers: bool = True
    # CPU: linear layers through oneDNN's prepacked weights (engine/kernels/packed_linears.py): 1.2-1.7x
    # F.linear in fp32, 5-7x in bf16 on AVX2; rows run at 30 bucketed counts, which bounds
    # oneDNN's primitive cache (one per row count) at ~80 MiB. False keeps F.linear
    prepack_linears: bool = True
    # Serve from an 8-bit copy derived from the (full-precision) weights, which stay the truth that
    # pushes, checksums and deltas use: "none", "int8" (CPU), "fp8" (CUDA, Hopper), "auto" (the
    # device's own 8 bits). The logprobs are the 8-bit policy's
    quantization: str = "none"
    # "float32": the LM head in fp32 in a bf16/fp16 engine (engine/kernels/fp32_head.py; vLLM's
    # hf_overrides {"head_dtype": "float32"}): logits never rounded to the model's dtype. "auto": the model's
    head_dtype: str = "auto"
    # a request's tokens and logprobs the same bits whatever shares its steps (batch size, neighbours,
    # prefix hits, thread count) and whichever kind of step computes a row (a prefill's row has a decode
    # row's bits): every kernel sums each row in one fixed order; on the CPU prefill attention runs the
    # decode kernel row by row and fp32 norms and silu run in C. Costs the fp32 mixtures of experts on
    # AVX-512 the experts' dot products at every row count (1.1x the expert GEMMs' time at 32 rows an
    # expert, 1.2x at a prefill's hundreds; AVX2's panels are invariant at any rows); False lets those take
    # the faster kernel, prefills SDPA's blocked kernel and torch's fp32 glue (HF's arithmetic op for op)
    batch_invariant: bool = True
    # CUDA: keep a model's worth of memory out of the KV cache for an overlapped push's staging
    # copy (rollout.serve sets it when --overlap-receive is on)
    reserve_push_staging: bool = False
    # CUDA: decode steps replayed from CUDA graphs captured per batch-size bucket (engine/decode_graphs.py);
    # True runs every step eagerly (vLLM's name)
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model) or not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model directory {self.model!r} does not exist or has no config.json")
        self.dtype = resolve_dtype(self.dtype, self.device, self.model)
        self.quantization = resolve_quantization(self.quantization, self.device)
        if self.head_dtype not in ("auto", "float32"):
            raise ValueError(f"head_dtype must be 'auto' or 'float32', got {self.head_dtype!r}")
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode must be 'processed' or 'raw', got {self.logprobs_mode!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.lora_versions < 0:
            raise ValueError(f"lora_versions must be >= 0, got {self.lora_versions}")
        for name in ("max_num_seqs", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(4096, self.max_model_len)
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}): a whole prompt is prefilled in one step"
            )
        self.tokenizer = self.tokenizer or self.model

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here: the sidecar's front end holds configs and imports no torch

        return getattr(torch, self.dtype)
