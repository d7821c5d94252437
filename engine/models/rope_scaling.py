"""Rotary embeddings' inverse frequencies as HF computes them for each rope type a config names
(transformers' modeling_rope_utils, op for op, so the cos/sin tables and greedy output are HF's):
`default`, `linear` (positions interpolated: every frequency divided by the factor) and `llama3`
(Llama 3.1+: long wavelengths divided by the factor, short ones kept, a smooth blend between).
Pure functions on a config's rope parameters; `SUPPORTED` names what the engine's own layers take
(another type, say `yarn` or `dynamic`, keeps transformers' modelling code)."""

from __future__ import annotations

import math

import torch

SUPPORTED = ("default", "linear", "llama3")


def rope_parameters(raw: dict) -> dict:
    """A config.json's rope parameters in transformers 5's form (`rope_parameters`), from either that
    or the older `rope_theta` + `rope_scaling` fields; `rope_type` always set."""
    rope = dict(raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10000.0),
                                                **(raw.get("rope_scaling") or {"rope_type": "default"})})
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return rope


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """HF's default rope: 1 / base^(2i / dim), on the CPU (the model may be built on the meta device)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim))


def inv_freq(rope: dict, head_dim: int, max_position_embeddings: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] fp32, the factor HF multiplies cos and sin by) for `rope`
    (rope_parameters' form). Raises ValueError for a type not in SUPPORTED."""
    kind = rope["rope_type"]
    freq = default_inv_freq(rope["rope_theta"], head_dim)
    if kind == "default":
        return freq, 1.0
    if kind == "linear":
        freq /= rope["factor"]
        return freq, 1.0
    if kind == "llama3":
        return llama3(freq, rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                      rope.get("original_max_position_embeddings", max_position_embeddings)), 1.0
    raise ValueError(f"rope type {kind!r} is not one of {SUPPORTED}")


def llama3(freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
           old_context_len: int) -> torch.Tensor:
    """Llama 3.1's frequency scaling (HF's _compute_llama3_parameters, the same ops in the same order)."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)
