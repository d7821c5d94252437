"""Convert a GGUF checkpoint into an ordinary HF model directory: float32 safetensors, the
tokenizer with its chat template, and a generation config that stops at the end of a turn.

transformers reads GGUF itself (dequantising to float, undoing llama.cpp's q/k permutation) but
refuses to `save_pretrained` what it read; so the weights move into a fresh model built from the
same config, and that is saved. Everything downstream then loads the directory like any other
checkpoint (`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from engine.errors import MissingExtraError

log = logging.getLogger(__name__)

STAMP = "gguf_convert.json"
CONVERTER = 1  # bump when the output changes, so cached conversions are redone
GGUF_INSTALL = "pip install -e '.[real]'"
# A chat template ends each turn with one of these; generation must stop there, whatever the
# GGUF calls its eos (often <|endoftext|>, which a chat model never writes after an answer).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# What the saved tokenizer must encode exactly as the GGUF's does.
PROBES = ["Hello world!", "  Two spaces, then\ttab and\nnewline.", "12345 + 678 = 13023", "naïve café, 東京"]
PROBE_CONVERSATION = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]


def require_gguf(install: str = GGUF_INSTALL) -> None:
    """Raise `MissingExtraError` (one line, with `install`) unless the `gguf` package is importable."""
    if importlib.util.find_spec("gguf") is None:
        raise MissingExtraError(f"reading GGUF files needs the 'gguf' package, which is not installed: {install}")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert `gguf_path` into the HF model directory `out_dir` and return it; once: a directory
    whose stamp names the same file is reused. The conversion is written to a temporary directory
    beside `out_dir` and renamed into place, so a half-written one is never used. An older
    conversion there is replaced; any other non-empty directory is refused, never deleted."""
    src, out = Path(gguf_path), Path(out_dir)
    stamp = {"gguf": src.name, "bytes": src.stat().st_size, "converter": CONVERTER}
    if read_stamp(out) == stamp:
        return out
    if out.is_dir() and read_stamp(out) is None and any(out.iterdir()):
        raise FileExistsError(f"{out} holds something other than a GGUF conversion; not replacing it")
    require_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # NOTE: not tempfile.mkdtemp, whose 0700 the renamed directory would keep
    try:
        write_hf_dir(src, tmp)
        (tmp / STAMP).write_text(json.dumps(stamp))  # last: only a complete directory carries it
        publish(tmp, out, stamp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_stamp(out: Path) -> dict | None:
    try:
        return json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None


def publish(tmp: Path, out: Path, stamp: dict) -> None:
    """Move the finished `tmp` to `out`, replacing an older conversion (or an empty directory)."""
    if read_stamp(out) == stamp:  # NOTE: another process converted the same file meanwhile
        shutil.rmtree(tmp)
        return
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def write_hf_dir(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log.info("converting %s into %s (dequantising to float32)", src, dst)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    model = plain_copy(gguf_model)
    del gguf_model
    model.generation_config.eos_token_id = stop_token_ids(model.generation_config.eos_token_id, tokenizer)
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    problems = tokenizer_problems(tokenizer, AutoTokenizer.from_pretrained(dst))
    if problems:
        raise ValueError(f"the saved tokenizer differs from the GGUF's: {'; '.join(problems)}")
    log.info("converted in %.1fs: %s params, stops at %s", time.perf_counter() - t0,
             f"{sum(p.numel() for p in model.parameters()):,}", model.generation_config.eos_token_id)


def plain_copy(gguf_model):
    """The same weights in a model built from the same config minus its GGUF quantization entry,
    which `save_pretrained` accepts. Every tensor is checked finite on the way (a NaN or inf
    anywhere makes its sum non-finite; the sum is 3x faster than `isfinite(t).all()`)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        cfg.pop(key, None)
    with torch.device("meta"):  # no random init: every weight is assigned below
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    state = gguf_model.state_dict()
    for name, tensor in tqdm(state.items(), desc="checking tensors", unit="tensor"):
        if not torch.isfinite(tensor.sum()):
            raise ValueError(f"{name} holds non-finite values after dequantisation")
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    out, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if model.config.tie_word_embeddings and out.data_ptr() != emb.data_ptr():
        raise ValueError("tie_word_embeddings is set but lm_head is not the embedding matrix")
    return model.eval()


def stop_token_ids(eos, tokenizer) -> list[int]:
    """The model's eos ids, the tokenizer's eos, and every end-of-turn token its chat template writes."""
    ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    template, vocab = tokenizer.chat_template or "", tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab and t in template)
    return sorted(ids)


def tokenizer_problems(source, saved) -> list[str]:
    """How `saved` (reloaded by AutoTokenizer) differs from `source`: class, chat template, ids."""
    problems = []
    if type(saved) is not type(source):
        problems.append(f"reloads as {type(saved).__name__}, not {type(source).__name__}")
    if saved.chat_template != source.chat_template:
        problems.append("the chat template changed")
    problems += [f"{text!r} encodes differently" for text in PROBES if saved(text).input_ids != source(text).input_ids]
    if source.chat_template:
        ids = [t.apply_chat_template(PROBE_CONVERSATION, add_generation_prompt=True, tokenize=True)["input_ids"]
               for t in (source, saved)]
        if ids[0] != ids[1]:
            problems.append("apply_chat_template gives other ids")
    return problems
