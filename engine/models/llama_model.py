"""Llama-shaped causal LMs (llama incl. Llama 3's scaled rope, qwen2, qwen3, mistral, phi3 incl. Phi-4-mini's
partial rotary and longrope) built from a model directory without transformers, so that an engine core
starts by importing torch alone (issue 39 item 1: transformers' modelling code pulls in torch._dynamo,
DTensor and sympy, ~40% of a core's start).

The modules, their attribute names and their parameters' names are HF's own
(`model.layers.0.self_attn.q_proj.weight`, a tied `lm_head`; Phi-3's fused `qkv_proj` and `gate_up_proj`),
so pushes, checksums, LoRA hooks and host copies see the same model either way; the decoder layers run
engine/models/fused_layers.py's forward, the norm, embedding, rotary tables and head are HF's arithmetic
op for op, so greedy output stays token-for-token HF's. A directory this does not cover (another
architecture, a rope type engine/models/rope_scaling.py does not compute, .bin weights, a checkpoint
whose names do not fit) is loaded by transformers, as before: `unsupported` says why. Sliding windows
are each layer's as HF's config classes set them (`layer_window`), attended by engine/models/attention.py.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
from torch import nn

from engine.models import fused_layers, native_layers, rope_scaling

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")
FUSED_PROJECTIONS = ("phi3",)  # one qkv_proj and one gate_up_proj a layer, as the checkpoint has them
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}  # q/k RMS norms: per head, or over the projection
ROPE_BUFFER = "rotary_emb.inv_freq"  # in some older checkpoints; computed here, never loaded


def read_config(model_dir: str) -> SimpleNamespace:
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    cfg = SimpleNamespace(**raw)
    cfg.head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    cfg.rope = rope_scaling.rope_parameters(raw)
    cfg.rope_type, cfg.rope_theta = cfg.rope["rope_type"], cfg.rope["rope_theta"]
    cfg.tie_word_embeddings = raw.get("tie_word_embeddings", True)
    return cfg


def weight_files(model_dir: str) -> list[str] | None:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(model_dir, n) for n in json.load(f)["weight_map"].values()})
    single = os.path.join(model_dir, "model.safetensors")
    return [single] if os.path.isfile(single) else None


def layer_window(cfg: SimpleNamespace, index: int) -> int | None:
    """Layer `index`'s sliding window in keys (None: full attention), as transformers 5's config and
    attention classes set it: Mistral, Mixtral and Phi-3 every layer at `sliding_window`; Qwen2/Qwen3 (and their
    MoE) only with `use_sliding_window`, on the layers `layer_types` marks "sliding_attention" (without
    it: Qwen2/Qwen3 from `max_window_layers` up, Qwen2-MoE the even ones below it, Qwen3-MoE all)."""
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type in ("mistral", "mixtral", "phi3"):  # Phi3Attention passes config.sliding_window on every layer
        return window or None
    if cfg.model_type not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") or not window:
        return None
    if not getattr(cfg, "use_sliding_window", False):
        return None
    types, top = getattr(cfg, "layer_types", None), getattr(cfg, "max_window_layers", 28)
    if cfg.model_type == "qwen3_moe":
        sliding = True  # its attention reads config.sliding_window whatever the layer
    elif types is not None:
        sliding = types[index] == "sliding_attention"
    elif cfg.model_type == "qwen2_moe":
        sliding = index % 2 == 0 and index < top
    else:
        sliding = index >= top
    return window if sliding else None


def unsupported(model_dir: str, archs: tuple[str, ...] = ARCHS, max_model_len: int | None = None) -> str | None:
    """Why this directory needs transformers' modelling code (None: it does not)."""
    try:
        cfg = read_config(model_dir)
    except (OSError, KeyError, ValueError) as e:
        return f"its config.json cannot be read here ({type(e).__name__}: {e})"
    max_positions = getattr(cfg, "max_position_embeddings", None)
    rope_moves = rope_scaling.not_fixed_within(cfg.rope, max_model_len, max_positions)
    checks = [
        (cfg.model_type in archs, f"model type {cfg.model_type!r}"),
        (cfg.rope_type in rope_scaling.SUPPORTED, f"rope type {cfg.rope_type!r}"),
        (rope_moves is None, rope_moves),
        (cfg.rope.get("partial_rotary_factor", 1.0) == 1.0 or cfg.model_type == "phi3",  # HF's Phi3 slices it
         "a partial rotary embedding"),
        (getattr(cfg, "hidden_act", "silu") == "silu", f"activation {getattr(cfg, 'hidden_act', None)!r}"),
        (getattr(cfg, "quantization_config", None) is None, "a quantized checkpoint"),
        (not getattr(cfg, "mlp_bias", False), "biases in the MLP"),
        (weight_files(model_dir) is not None, "weights that are not safetensors"),
    ]
    return next((why for ok, why in checks if not ok), None)


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """Built on the meta device and filled from the checkpoint: nothing to initialise (torch's
        init on meta tensors imports torch._dynamo, seconds of a core's start)."""


class Embedding(nn.Embedding):
    reset_parameters = Linear.reset_parameters


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # HF's LlamaRMSNorm, as one call (fused_layers.rms_norm)
        return fused_layers.rms_norm(self, x)


class Attention(nn.Module):
    def __init__(self, cfg: SimpleNamespace, layer_idx: int):
        super().__init__()
        # qwen2: biases on q, k, v and none on o; llama, mistral, qwen3: `attention_bias` on all four
        qkv_bias = o_bias = getattr(cfg, "attention_bias", False)
        if cfg.model_type in ("qwen2", "qwen2_moe"):
            qkv_bias, o_bias = True, False
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer_idx, self.head_dim, self.scaling = layer_idx, d, d**-0.5
        self.sliding_window = layer_window(cfg, layer_idx)
        self.qkv_sizes = (h * d, kv * d, kv * d)
        if cfg.model_type in FUSED_PROJECTIONS:  # q, k, v stacked by rows in one linear, after o (HF's Phi3Attention)
            self.o_proj = Linear(h * d, cfg.hidden_size, bias=o_bias)
            self.qkv_proj = Linear(cfg.hidden_size, sum(self.qkv_sizes), bias=qkv_bias)
        else:
            self.q_proj = Linear(cfg.hidden_size, h * d, bias=qkv_bias)
            self.k_proj = Linear(cfg.hidden_size, kv * d, bias=qkv_bias)
            self.v_proj = Linear(cfg.hidden_size, kv * d, bias=qkv_bias)
            self.o_proj = Linear(h * d, cfg.hidden_size, bias=o_bias)
        # fused_layers.attention_block runs them where HF's do: after the projections, before the rotation
        self.qk_norm = QK_NORM.get(cfg.model_type)
        if self.qk_norm is not None:
            width = (d, d) if self.qk_norm == "head" else (h * d, kv * d)
            self.q_norm = RMSNorm(width[0], cfg.rms_norm_eps)
            self.k_norm = RMSNorm(width[1], cfg.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, cfg: SimpleNamespace):
        super().__init__()
        if getattr(cfg, "model_type", None) in FUSED_PROJECTIONS:  # gate then up by rows (HF's Phi3MLP chunks it)
            self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        else:
            self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = nn.SiLU()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: SimpleNamespace, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    forward = fused_layers._layer_forward


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: SimpleNamespace):
        super().__init__()
        # on the CPU even while the model is built on the meta device
        dims = rope_scaling.rotary_dims(cfg.rope, cfg.head_dim)  # a head's, or fewer: a partial rotary
        inv_freq, self.attention_scaling = rope_scaling.inv_freq(cfg.rope, dims,
                                                                 getattr(cfg, "max_position_embeddings", None))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # HF multiplies by it always; by 1.0 that is exact
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


class DecoderModel(nn.Module):
    def __init__(self, cfg: SimpleNamespace, layer: type[nn.Module] = DecoderLayer):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope = self.rotary_emb(h, position_ids)
        done = native_layers.decode(self, h, rope)  # a decode step in one C call, where it runs
        if done is not None:
            return done
        for layer in self.layers:
            h = layer(h, position_embeddings=rope)
        return self.norm(h)


class CausalLM(nn.Module):
    """What the engine calls of a HF causal LM: `forward(input_ids, position_ids, logits_to_keep)`
    with `.logits`, `.config`, `.generation_config`, `.dtype`, `get_output_embeddings()`."""

    def __init__(self, cfg: SimpleNamespace, generation_config: SimpleNamespace,
                 layer: type[nn.Module] = DecoderLayer):
        super().__init__()
        self.config, self.generation_config = cfg, generation_config
        self.model = DecoderModel(cfg, layer)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def get_output_embeddings(self) -> Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0) -> SimpleNamespace:
        del use_cache  # the KV cache is the engine's (engine/models/attention.py)
        h = self.model(input_ids, position_ids)
        rows = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return SimpleNamespace(logits=self.lm_head(h[:, rows, :]))


def _generation_config(model_dir: str, cfg: SimpleNamespace) -> SimpleNamespace:
    path, raw = os.path.join(model_dir, "generation_config.json"), {}
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
    return SimpleNamespace(eos_token_id=raw.get("eos_token_id", getattr(cfg, "eos_token_id", None)))


def load(model_dir: str, dtype: torch.dtype, layer: type[nn.Module] = DecoderLayer,
         rename=None, max_model_len: int | None = None) -> CausalLM | None:
    """The model with its checkpoint's weights in `dtype`; None when the checkpoint's names do not
    fit this model (the caller loads it with transformers then). `layer`: the decoder layer's
    class; `rename(state, cfg)`: the checkpoint's tensors under the model's names (experts fused);
    `max_model_len`: the engine's, which picks longrope's factors (rope_scaling.for_context)."""
    cfg = read_config(model_dir)
    cfg.rope = rope_scaling.for_context(cfg.rope, max_model_len)
    return load_into(model_dir, dtype, cfg, lambda cfg, gen: CausalLM(cfg, gen, layer), rename)


def load_into(model_dir: str, dtype: torch.dtype, cfg: SimpleNamespace, build, rename=None):
    """`build(cfg, generation_config)`'s model (made on the meta device) with the checkpoint's weights in
    `dtype`; None when the checkpoint's names do not fit it."""
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = build(cfg, _generation_config(model_dir, cfg))
    state = {}
    for path in weight_files(model_dir):
        state.update(load_file(path))
    if rename is not None:
        state = rename(state, cfg)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if not k.endswith(ROPE_BUFFER)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    if set(state) != expected:
        return None
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
