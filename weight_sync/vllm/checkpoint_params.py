"""A checkpoint directory's parameters as a push must name them: for engines whose own parameters
do not look like the trainer's (vLLM fuses q/k/v and gate/up, and on CPU repacks linear weights for
oneDNN), a push is checked against the checkpoint's HF names, shapes and dtypes instead.

Reads only the safetensors headers (no tensor data) until `load_checkpoint` is asked for the values.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from weight_sync.common.manifest import DTYPES, ParamInfo, dtype_name
from weight_sync.engine_side.staging_memory import st_dtype

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _files(model_dir: str | os.PathLike) -> list[Path]:
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not d.is_dir() or not files:
        raise ValueError(f"{model_dir} is not a checkpoint directory with .safetensors files: a push into this "
                         "engine is checked against the checkpoint's tensors")
    return files


def _tied(model_dir: str | os.PathLike) -> bool:
    with open(Path(model_dir) / "config.json") as f:
        cfg = json.load(f)
    text = cfg.get("text_config") or {}
    return bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def checkpoint_params(model_dir: str | os.PathLike, serving_dtype: torch.dtype
                      ) -> tuple[dict[str, ParamInfo], dict[str, str]]:
    """(canonical name -> ParamInfo in the serving dtype, alias -> canonical), as
    `weight_sync.common.manifest.model_params` gives them for a model: with tied embeddings the output
    head is an alias of the embedding whether or not the checkpoint stores it. Integer and bool
    tensors keep their own dtype (the engine does not cast them)."""
    from safetensors import safe_open

    infos: dict[str, ParamInfo] = {}
    for file in _files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = st_dtype(sl.get_dtype())
                served = dtype_name(serving_dtype) if torch.is_floating_point(torch.empty((), dtype=DTYPES[dtype])) \
                    else dtype
                infos[name] = ParamInfo(served, tuple(sl.get_shape()))
    aliases = {}
    if _tied(model_dir) and EMBED in infos:
        infos.pop(HEAD, None)
        aliases[HEAD] = EMBED
    return infos, aliases


def load_checkpoint(model_dir: str | os.PathLike, serving_dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the names `checkpoint_params` gives, floating ones in the
    serving dtype: what an engine serves before any push (for its checksum and its copies)."""
    from safetensors import safe_open

    names, _ = checkpoint_params(model_dir, serving_dtype)
    for file in _files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in names:
                    t = f.get_tensor(name)
                    yield name, t.to(serving_dtype) if t.is_floating_point() else t
