"""Rotary embeddings' inverse frequencies as HF computes them for each rope type a config names
(transformers' modeling_rope_utils, op for op, so the cos/sin tables and greedy output are HF's):
`default`, `linear` (positions interpolated: every frequency divided by the factor), `llama3`
(Llama 3.1+: long wavelengths divided by the factor, short ones kept, a smooth blend between),
`yarn` (Qwen3's and Qwen2.5's long-context setting, DeepSeek's: the same blend by rotations over the
original context, and cos and sin multiplied by an attention factor), `dynamic` (NTK: the base
grows once a sequence passes max_position_embeddings, from the longest position in HF's batch; below
it the default frequencies, so it runs here only where the engine's sequences stay below it:
`not_fixed_within`) and `longrope` (Phi-3.5's and Phi-4-mini's: each frequency divided by its short factor,
cos and sin times an attention factor; HF takes the long factors once the batch's longest position
passes original_max_position_embeddings, which would make a row's rotation depend on its batch: an
engine whose max_model_len passes it takes the long factors at every position, as vLLM does:
`for_context`). Pure functions on a config's rope parameters; `SUPPORTED` names what the engine's own
layers take (another type keeps transformers' modelling code)."""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)

SUPPORTED = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")  # types that read original_max_position_embeddings


def rope_parameters(raw: dict) -> dict:
    """A config.json's rope parameters in transformers 5's form (`rope_parameters`), from either that
    or the older `rope_theta` + `rope_scaling` fields; `rope_type` always set."""
    rope = dict(raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10000.0),
                                                **(raw.get("rope_scaling") or {"rope_type": "default"})})
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in raw:  # an older config's top-level field (Phi-4-mini's), as Phi3Config reads it
        rope.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if rope["rope_type"] in ORIGINAL_CONTEXT:  # as HF standardizes it: a top-level field wins (Phi-3's)
        if "original_max_position_embeddings" in raw:
            rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        elif "max_position_embeddings" in raw:
            rope.setdefault("original_max_position_embeddings", raw["max_position_embeddings"])
    return rope


def not_fixed_within(rope: dict, max_model_len: int | None, max_position_embeddings: int | None) -> str | None:
    """Why the rope's frequencies are not one table for every sequence of up to max_model_len tokens (None:
    they are): `dynamic`'s, which HF recomputes from the batch's longest position once it passes
    max_position_embeddings (a row's rotation would then depend on its batch)."""
    limit = max_position_embeddings
    if rope["rope_type"] != "dynamic" or (None not in (max_model_len, limit) and max_model_len <= limit):
        return None
    return (f"rope type 'dynamic' past max_position_embeddings {limit} (max_model_len {max_model_len}: its "
            "frequencies would follow the batch's longest sequence)")


def for_context(rope: dict, max_model_len: int | None) -> dict:
    """The rope an engine of up to max_model_len tokens a sequence serves: `rope`, but longrope's long factors
    at every position where max_model_len passes original_max_position_embeddings (vLLM's choice: one
    table whatever the batch; HF's forward takes the short ones for a batch that stays within it, so
    there a sequence that short is rotated otherwise than by the trainer's HF model)."""
    if (rope["rope_type"] != "longrope" or max_model_len is None
            or max_model_len <= rope["original_max_position_embeddings"]):
        return rope
    log.warning("longrope's long factors at every position: max_model_len %d passes its original context of %d "
                "(HF rotates a batch within that by the short ones; a max_model_len of at most %d keeps them)",
                max_model_len, rope["original_max_position_embeddings"], rope["original_max_position_embeddings"])
    return {**rope, "long_factors": True}


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
    if kind == "yarn":
        return yarn(rope, head_dim, max_position_embeddings)
    if kind == "dynamic":  # the table HF starts from and keeps while no position passes max_position_embeddings
        return dynamic_ntk(rope["rope_theta"], head_dim, rope["factor"], max_position_embeddings), 1.0
    if kind == "longrope":
        return longrope(rope, head_dim, max_position_embeddings)
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


def dynamic_ntk(base: float, dim: int, factor: float, max_position_embeddings: int) -> torch.Tensor:
    """HF's _compute_dynamic_ntk_parameters at a sequence length of max_position_embeddings (the same
    ops: the base times 1.0 to a power, so the default frequencies)."""
    seq_len = max_position_embeddings
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim))


def yarn_attention_factor(rope: dict, factor: float) -> float:
    """The factor HF multiplies cos and sin by: the config's, else 0.1 ln(factor) + 1 (DeepSeek's
    ratio of two such where mscale and mscale_all_dim are given)."""
    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.get("attention_factor") is not None:
        return rope["attention_factor"]
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def yarn(rope: dict, dim: int, max_position_embeddings: int | None) -> tuple[torch.Tensor, float]:
    """HF's _compute_yarn_parameters (on the CPU, as default_inv_freq): each frequency extrapolated
    (kept) where it turns more than beta_fast times over the original context, interpolated (divided
    by the factor) where fewer than beta_slow, a linear ramp over the dimensions between."""
    base, original = rope["rope_theta"], rope["original_max_position_embeddings"]
    factor = rope.get("factor")
    if factor is None:  # DeepSeek-V3's configs: the ratio of the two context lengths
        factor = max_position_embeddings / original
    attention_factor = yarn_attention_factor(rope, factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor


def rotary_dims(rope: dict, head_dim: int) -> int:
    """The values of a head the rotation turns: all, or `partial_rotary_factor` of them (Phi-4-mini's 3/4),
    as HF's rope functions compute it."""
    return int(head_dim * rope.get("partial_rotary_factor", 1.0))


def longrope(rope: dict, dim: int, max_position_embeddings: int | None) -> tuple[torch.Tensor, float]:
    """HF's _compute_longrope_parameters: 1 / (short_factor * base^(2i / dim)) (the table HF keeps while
    no position passes original_max_position_embeddings), or by the long factors where `for_context`
    chose them, and the attention factor (the config's, else sqrt(1 + ln(factor) / ln(original)), factor
    the ratio of the contexts; the same for both)."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = rope["long_factor"] if rope.get("long_factors") else rope["short_factor"]
    ext_factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext_factors * rope["rope_theta"] ** inv_freq_shape), attention_factor
