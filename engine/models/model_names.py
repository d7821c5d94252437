"""What a `--model` flag accepts: a model directory, passed through unchanged, or a name that
builds or converts a cached directory: a real model (`engine.models.real_models.PRESETS`, e.g.
smollm2) or an embedded tiny one (`engine.models.tiny_model.SIZES`, Qwen2, random weights; `tiny-moe`,
the tiny size as a Qwen3-MoE of 8 experts, 2 a token; `tiny-qwen3`, `tiny-llama3`, `tiny-gemma3`, `tiny-phi3`:
the tiny size in today's dense families, q/k norms, Llama 3's scaled rope, Gemma 3's layers and windows,
Phi-3's fused projections and windows)."""

from __future__ import annotations

import os

from engine.errors import MissingExtraError
from engine.models.real_models import PRESETS, real_model_dir
from engine.models.tiny_model import SIZES, build_tiny_model, default_model_dir

TINY_ARCHS = {"tiny-moe": ("tiny", "qwen3_moe"), "tiny-qwen3": ("tiny", "qwen3"),
              "tiny-llama3": ("tiny", "llama3"), "tiny-gemma3": ("tiny", "gemma3"),
              "tiny-phi3": ("tiny", "phi3")}  # name -> (size, arch)

MODEL_HELP = (f"HF model directory, or a name: a real model ({', '.join(PRESETS)}; needs the 'real' extra, see "
              f"README) or an embedded tiny model ({', '.join([*SIZES, *TINY_ARCHS])})")


def resolve_model(name_or_path: str | os.PathLike) -> str:
    """A local model directory for `name_or_path`. A name wins over a same-named directory in the
    working directory (write ./smollm2 for that); anything else is returned unchanged."""
    name = os.fspath(name_or_path)
    if name in PRESETS:
        return str(real_model_dir(name))
    if name in SIZES:
        return str(build_tiny_model(default_model_dir(name), name))
    if name in TINY_ARCHS:
        size, arch = TINY_ARCHS[name]
        return str(build_tiny_model(default_model_dir(size, arch), size, arch))
    return name


def resolve_model_arg(name_or_path: str | os.PathLike) -> str:
    """`resolve_model` for CLIs: a missing extra exits with its one-line message, not a traceback."""
    try:
        return resolve_model(name_or_path)
    except MissingExtraError as e:
        raise SystemExit(f"error: {e}") from None
