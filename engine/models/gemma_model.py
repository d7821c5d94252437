"""Gemma 3's text models (`gemma3_text`: Gemma 3 1B, and the text tower's shape of the larger ones) on the
engine's own modules, beside engine/models/llama_model.py's families and built the same way: no
transformers import, HF's module tree and parameter names (four norms a layer, q/k norms, a tied head), so
pushes, checksums, LoRA hooks and host copies see the trainer's model.

What sets Gemma 3 apart from Llama, each done as HF's modules do it, op for op, so that fp32 greedy output
is HF's token for token: the embeddings times sqrt(hidden) (rounded to the weights' dtype); RMS norms that
scale by (1 + w) in fp32 and round once; a norm after the attention and one on each side of the MLP;
GELU (tanh) for SiLU; attention scaled by `query_pre_attn_scalar`^-1/2; five sliding-window layers to one
global one (`layer_types`), each kind with its own rope table (10k and 1M bases). The attention is the paged
one of engine/models/attention.py (each layer's window), the linears the engine's kernels, the norms and
GELU in C (engine/kernels/native/layer_glue.c) in bf16 and in a batch-invariant fp32 engine (its default;
the fp32 sums in another order than torch's, within an ulp or so); a decode step's layers in one C call
(engine/kernels/native/decode_layers.c's Gemma order: the same kernels on the same values, so the Python
forward's bits), a prefill's in Python.

Soft-capped logits (Gemma 2's, `attn_logit_softcapping`, `final_logit_softcapping`) and bidirectional
attention are not built: such a directory is loaded by transformers (`unsupported` says why).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import fused_linears, native_glue
from engine.models import attention, fused_layers, llama_model, native_layers, rope_scaling

ARCHS = ("gemma3_text",)
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # what HF's configs name tanh-approximated GELU
LAYER_TYPES = ("sliding_attention", "full_attention")


def is_gemma(cfg) -> bool:
    return getattr(cfg, "model_type", None) in ARCHS


def read_config(model_dir: str) -> SimpleNamespace:
    """config.json as transformers 5's Gemma3TextConfig reads it: `layer_types` (or every
    `sliding_window_pattern`-th layer global, 6 by default), and a rope per layer type (`rope_parameters`
    by type, or the older `rope_theta` + `rope_scaling` for the global layers and `rope_local_base_freq`
    for the sliding ones)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    cfg = SimpleNamespace(**raw)
    cfg.head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    cfg.tie_word_embeddings = raw.get("tie_word_embeddings", True)
    cfg.rms_norm_eps = raw.get("rms_norm_eps", 1e-6)
    cfg.query_pre_attn_scalar = raw.get("query_pre_attn_scalar", 256)
    cfg.sliding_window = raw.get("sliding_window", 4096)
    cfg.activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    pattern = raw.get("sliding_window_pattern", 6)
    cfg.layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(raw["num_hidden_layers"])]
    by_type = dict(raw.get("rope_parameters") or {})
    if not by_type:
        by_type["full_attention"] = {"rope_type": "default", **(raw.get("rope_scaling") or {})}
    full = {"rope_type": "default", **(by_type.get("full_attention") or {})}
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    sliding = {"rope_type": "default", **(by_type.get("sliding_attention") or {})}
    sliding.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    mpe = raw.get("max_position_embeddings")
    cfg.ropes = {kind: rope_scaling.rope_parameters({"rope_parameters": rope, "max_position_embeddings": mpe})
                 for kind, rope in (("full_attention", full), ("sliding_attention", sliding))}
    return cfg


def unsupported(model_dir: str, max_model_len: int | None = None) -> str | None:
    """Why this directory needs transformers' modelling code (None: it does not)."""
    try:
        cfg = read_config(model_dir)
    except (OSError, KeyError, ValueError, TypeError) as e:
        return f"its config.json cannot be read here ({type(e).__name__}: {e})"
    mpe = getattr(cfg, "max_position_embeddings", None)
    checks = [
        (cfg.model_type in ARCHS, f"model type {cfg.model_type!r}"),
        (all(t in LAYER_TYPES for t in cfg.layer_types), f"layer types {sorted(set(cfg.layer_types))}"),
        *((rope["rope_type"] in rope_scaling.SUPPORTED, f"rope type {rope['rope_type']!r}")
          for rope in cfg.ropes.values()),
        *((why is None, why) for why in (rope_scaling.not_fixed_within(rope, max_model_len, mpe)
                                         for rope in cfg.ropes.values())),
        (cfg.activation in ACTIVATIONS, f"activation {cfg.activation!r}"),
        (getattr(cfg, "attn_logit_softcapping", None) is None, "soft-capped attention logits"),
        (getattr(cfg, "final_logit_softcapping", None) is None, "soft-capped final logits"),
        (not getattr(cfg, "use_bidirectional_attention", False), "bidirectional attention"),
        (not getattr(cfg, "attention_bias", False), "biases in the attention"),
        (getattr(cfg, "quantization_config", None) is None, "a quantized checkpoint"),
        (llama_model.weight_files(model_dir) is not None, "weights that are not safetensors"),
    ]
    return next((why for ok, why in checks if not ok), None)


def _glue_in_c(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module`'s elementwise glue runs in C (engine/kernels/native/layer_glue.c's Gemma kernels): in
    bf16 always (a decode step 3-11% faster than on torch's ops), in fp32 where the engine is batch invariant."""
    return x.device.type == "cpu" and (x.dtype == torch.bfloat16 or getattr(module, native_glue.C_GLUE, False))


class RMSNorm(nn.Module):
    """Gemma's: x normed in fp32, times (1 + w) in fp32, rounded to x's dtype once (Llama's rounds before
    multiplying by w). The weight is stored as w (HF's name and values: a push's tensor)."""

    GLUE_IN_C = True  # native_glue.glue_in_c marks it

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _glue_in_c(self, x):
            n = x.shape[-1]
            out = native_glue.gemma_norm(x.reshape(-1, n).contiguous(), self.weight, self.eps)
            if out is not None:
                return out.view(x.shape)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: SimpleNamespace, layer_idx: int):
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer_idx, self.head_dim = layer_idx, d
        self.scaling = cfg.query_pre_attn_scalar**-0.5
        self.layer_type = cfg.layer_types[layer_idx]
        self.qk_norm = "head"  # per head, before the rotation (what engine/models/native_layers.py asks)
        self.sliding_window = cfg.sliding_window if self.layer_type == "sliding_attention" else None
        self.q_proj = llama_model.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = llama_model.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = llama_model.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = llama_model.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t, d = x.shape[1], self.head_dim
        qkv = fused_linears.project(self, x)  # one GEMM where the three share a copy
        q, k, v = qkv if qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k = self.q_norm(q.view(t, -1, d)), self.k_norm(k.view(t, -1, d))
        cos, sin_signed = attention.rope_tables(rope)
        out = attention.rotate_and_attend(self.layer_idx, q, k, v.view(t, -1, d), cos, sin_signed, self.scaling,
                                          fused_layers._rotate, self.sliding_window)
        return self.o_proj(out.reshape(1, t, -1))


class MLP(nn.Module):
    GLUE_IN_C = True

    def __init__(self, cfg: SimpleNamespace):
        super().__init__()
        self.gate_proj = llama_model.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = llama_model.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = llama_model.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        gate_up = fused_linears.project(self, y)
        gate, up = gate_up if gate_up is not None else (self.gate_proj(y), self.up_proj(y))
        act = native_glue.silu_mul(gate[0], up[0], "gelu_tanh_mul") if _glue_in_c(self, gate) else None
        return self.down_proj(F.gelu(gate, approximate="tanh") * up if act is None else act.view(gate.shape))


class DecoderLayer(nn.Module):
    C_DECODE_LOOP = GEMMA = True  # a decode step's layers in one C call (engine/models/native_layers.py)

    def __init__(self, cfg: SimpleNamespace, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, ropes: dict) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), ropes[self.self_attn.layer_type]))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class RotaryEmbedding(nn.Module):
    """One table per layer type (HF's `{type}_inv_freq` buffers, never loaded)."""

    def __init__(self, cfg: SimpleNamespace):
        super().__init__()
        self.scaling = {}
        for kind, rope in cfg.ropes.items():
            inv_freq, self.scaling[kind] = rope_scaling.inv_freq(rope, cfg.head_dim,
                                                                 getattr(cfg, "max_position_embeddings", None))
            self.register_buffer(f"{kind}_inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict:
        out = {}
        for kind, scaling in self.scaling.items():
            inv_freq = getattr(self, f"{kind}_inv_freq")
            freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
            emb = torch.cat((freqs, freqs), dim=-1)
            out[kind] = ((emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype))
        return out


class DecoderModel(nn.Module):
    def __init__(self, cfg: SimpleNamespace):
        super().__init__()
        self.embed_tokens = llama_model.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5  # HF keeps it as an fp32 tensor, cast to the weights' dtype
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        h = self.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=torch.float32).to(w.dtype)
        ropes = self.rotary_emb(h, position_ids)
        done = native_layers.decode(self, h, ropes)  # a decode step in one C call, where it runs
        if done is not None:
            return done
        for layer in self.layers:
            h = layer(h, ropes)
        return self.norm(h)


class CausalLM(llama_model.CausalLM):
    def __init__(self, cfg: SimpleNamespace, generation_config: SimpleNamespace):
        nn.Module.__init__(self)
        self.config, self.generation_config = cfg, generation_config
        self.model = DecoderModel(cfg)
        self.lm_head = llama_model.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


def load(model_dir: str, dtype: torch.dtype, max_model_len: int | None = None) -> CausalLM | None:
    """The model with its checkpoint's weights in `dtype`; None when the checkpoint's names do not fit.
    `max_model_len`: the engine's, which picks a longrope's factors (rope_scaling.for_context)."""
    cfg = read_config(model_dir)
    cfg.ropes = {kind: rope_scaling.for_context(rope, max_model_len) for kind, rope in cfg.ropes.items()}
    return llama_model.load_into(model_dir, dtype, cfg, lambda cfg, gen: CausalLM(cfg, gen))
