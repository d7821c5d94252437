"""A model directory as the engine's model: ours (engine/models/llama_model.py) where it covers the
architecture, else transformers' with the paged attention plugged in; on the CPU, optionally, its
linear layers on prepacked oneDNN weights (engine/kernels/packed_linears.py); with `quantization`, on 8-bit
copies of their weights (engine/kernels/int8_linears.py on the CPU, engine/kernels/fp8_linears.py on CUDA)."""

from __future__ import annotations

import logging

import torch

from engine.kernels import (derived_weights, fp32_head, fused_linears, huge_pages, int8_linears, moe_experts,
                            native_glue, packed_linears)
from engine.models import attention, fused_layers, gemma_model, llama_model, moe_model
from engine.config import EngineConfig

log = logging.getLogger(__name__)


def load_model(cfg: EngineConfig, device: torch.device) -> torch.nn.Module:
    """The model of `cfg.model`: our own modules where they cover it (no transformers import:
    engine/models/llama_model.py, moe_model.py, gemma_model.py), else transformers' with the paged
    attention plugged in."""
    own = own_module(cfg.model)
    why_not = own.unsupported(cfg.model, max_model_len=cfg.max_model_len) if cfg.fuse_layers else "fused layers off"
    model = own.load(cfg.model, cfg.torch_dtype, max_model_len=cfg.max_model_len) if why_not is None else None
    if model is None:
        log.info("loading %s with transformers (%s)", cfg.model, why_not or "its weights' names are not ours")
        model = _load_hf(cfg)
    if cfg.prepack_linears and device.type == "cpu":
        packed_dtype = packed_linears.compute_dtype(model.dtype)
        if packed_dtype is not None:
            packed_linears.pack(model, packed_dtype, cfg.max_num_seqs)
    model = model.to(device).eval()
    if device.type == "cpu" and not cfg.reserve_push_staging:  # a sidecar's engine moves them at start (adopt)
        huge_pages.move_parameters(model)  # out of the checkpoint's file mapping: the worker's Collapser takes them
    _quantize(model, cfg.quantization)
    for block in moe_model.sparse_blocks(model):
        block.batch_invariant = cfg.batch_invariant
    if cfg.prepack_linears and device.type == "cpu":
        moe_experts.attach_panels(moe_model.sparse_blocks(model))  # on AVX2: the experts over panels
    if cfg.batch_invariant and device.type == "cpu":
        native_glue.glue_in_c(model)  # a prefill row's fp32 norms and silu as a decode row's (the C loop's)
    if cfg.head_dtype == "float32":
        fp32_head.install(model, cfg.max_num_seqs)  # after _quantize: the head keeps the model's precision there
    if cfg.fuse_layers:
        fused_linears.group(model)  # after _quantize: a group serves its members' kind of copy
    if cfg.quantization in ("int8", "fp8") or cfg.head_dtype == "float32" or derived_weights.groups(model):
        derived_weights.refresh(model)  # now, not at the first request
    return model


def own_module(model_dir: str):
    """Which of the engine's own model modules would build `model_dir` (its `unsupported` says whether
    it can): Gemma 3's, the mixtures of experts', or the Llama-shaped dense families'."""
    try:
        cfg = llama_model.read_config(model_dir)
    except (OSError, KeyError, ValueError, TypeError):
        return llama_model  # whose unsupported says why
    return gemma_model if gemma_model.is_gemma(cfg) else moe_model if moe_model.is_moe(cfg) else llama_model


def _quantize(model: torch.nn.Module, quantization: str) -> None:
    """The linears on an 8-bit copy of their weights (derived by load_model, not at the first request)."""
    if quantization == "int8":
        log.info("int8 copies of %d linears", int8_linears.install(model))
    elif quantization == "fp8":
        from engine.kernels import fp8_linears

        log.info("fp8 copies of %d linears", fp8_linears.install(model))


def _load_hf(cfg: EngineConfig) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        cfg.model, dtype=cfg.torch_dtype, attn_implementation=attention.register()
    )
    if cfg.fuse_layers:
        why_not = fused_layers.unsupported(model)
        if why_not is None:
            fused_layers.fuse(model)
        else:
            log.info("HF's decoder layers run as they are (fused layers do not support %s)", why_not)
    return model


def quantized_bytes(model: torch.nn.Module) -> int:
    """The memory of the model's 8-bit copies (beside its full-precision weights), once derived: one
    byte a weight and its scales (each module's `_eight_bit_bytes`, set by int8_linears / fp8_linears)."""
    return sum(getattr(m, "_eight_bit_bytes", 0) for m in model.modules())
