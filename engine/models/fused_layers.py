"""Decoder layers of the Llama-shaped models (llama, qwen2, mistral) as one short function each.

HF's layer spends ~80 aten ops on a decode step (views and transposes into and out of its
[B, H, T, d] layout, rotate_half's slices and cat, the attention interface's reshapes); each is
a kernel launch or a dispatch on the host, and a GPU decode step is bound by them. This forward
keeps the tokens as [T, heads, d] from the projections to the cache, rotates with one flip, and
hands decode straight to the paged attention (engine/models/attention.py): about 50 ops a layer. It
calls the layer's own modules (norms, projections, activation), so the parameters, their names,
weight pushes and LoRA hooks are HF's, and the arithmetic is HF's op for op (the rotation's
flip and sign are exact), so greedy output stays token-for-token HF's.

A model of another architecture, or one using a feature this does not implement (sliding
windows), keeps HF's layers with the paged attention plugged into them. q/k norms (Qwen3's) run in
`attention_block` for the engine's own models (engine/models/llama_model.py); HF's modules with them keep
HF's layers.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from engine.kernels import fused_linears, native_glue
from engine.models import attention

ARCHS = ("llama", "qwen2", "mistral")
C_GLUE = native_glue.C_GLUE  # on a norm or an MLP whose fp32 glue runs in C (see native_glue)


def unsupported(model) -> str | None:
    """Why the fused forward cannot run this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in ARCHS:
        return f"model type {cfg.model_type!r}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", cfg.model_type == "mistral"):
        return "sliding-window attention"
    layer = model.model.layers[0]
    attn = layer.self_attn
    if any(hasattr(attn, n) for n in ("q_norm", "k_norm")) or not all(
        hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
    ):
        return f"attention module {type(attn).__name__}"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
        return f"norm module {type(layer.input_layernorm).__name__}"
    if not all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return f"MLP module {type(layer.mlp).__name__}"
    return None


def fuse(model) -> bool:
    """Give every decoder layer the fused forward; False (and nothing changed) when the model
    is not one it supports."""
    if unsupported(model) is not None:
        return False
    for layer in model.model.layers:
        layer.forward = types.MethodType(_layer_forward, layer)
    return True


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding, x * cos + rotate_half(x) * sin, with rotate_half as a flip of the
    two halves whose sign (-1 on the first half) is folded into `sin_signed`: exact. Tables narrower
    than a head (a partial rotary, Phi-4-mini's) rotate its first values and pass the rest, as HF's."""
    t, h, d = x.shape
    r = cos.shape[-1]
    if r < d:
        return torch.cat([_rotate(x[..., :r].contiguous(), cos, sin_signed), x[..., r:]], dim=-1)
    return x * cos + x.view(t, h, 2, d // 2).flip(2).view(t, h, d) * sin_signed


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's Llama/Qwen2 RMSNorm (x in fp32 times rsqrt(mean(x^2) + eps), back to x's dtype, times the
    weight). fp32 (and fp16) through `F.rms_norm`: one call from Python instead of eight; on the CPU
    torch 2.13 composes it of the same kernels HF's module runs, hence the same bits, checked in
    tests. bf16 on the CPU in one C pass (native_glue.add_rms_norm): HF's arithmetic but for the
    order of the mean's fp32 sum, so within one bf16 rounding of HF's, also checked."""
    return add_rms_norm(norm, x, None)[1]


def add_rms_norm(norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
    """(h, rms_norm(h)) with h = x + residual (x itself when residual is None)."""
    w, eps = norm.weight, norm.variance_epsilon
    if x.dtype == torch.bfloat16 or getattr(norm, C_GLUE, False):
        n = x.shape[-1]
        done = native_glue.add_rms_norm(x.reshape(-1, n), None if residual is None else residual.reshape(-1, n), w, eps)
        if done is not None:
            return done[0].view(x.shape), done[1].view(x.shape)
    h = x if residual is None else x + residual
    if h.dtype == w.dtype == torch.float32:
        return h, F.rms_norm(h, (h.shape[-1],), w, eps)
    return h, w * F.rms_norm(h.float(), (h.shape[-1],), None, eps).to(h.dtype)


def _layer_forward(self, hidden_states: torch.Tensor, position_embeddings=None, **_):
    h, y = attention_block(self, hidden_states, position_embeddings)
    return h + mlp_forward(self.mlp, y)


def attention_block(layer, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): the residual stream after the layer's attention, and h normed for its MLP. A q/k norm
    (`attn.qk_norm`: "head", per head, qwen3's; "full", over the projection, olmoe's) runs where
    HF's does, before the rotation."""
    attn = layer.self_attn
    x = rms_norm(layer.input_layernorm, hidden_states)
    t, d = x.shape[1], attn.head_dim
    if hasattr(attn, "qkv_proj"):  # one linear in the checkpoint (Phi-3's): HF's slices of its output
        q, k, v = attn.qkv_proj(x).split(attn.qkv_sizes, dim=-1)
    else:
        qkv = fused_linears.project(attn, x)  # one GEMM where the three share a copy
        q, k, v = qkv if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
    qk_norm = getattr(attn, "qk_norm", None)
    if qk_norm == "full":
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
    if qk_norm == "head":
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    cos, sin_signed = attention.rope_tables(position_embeddings)
    out = attention.rotate_and_attend(attn.layer_idx, q, k, v, cos, sin_signed, attn.scaling, _rotate,
                                      getattr(attn, "sliding_window", None))
    # reshape: CUDA's attention hands back heads-major strides (a copy there, as HF's reshape makes);
    # the CPU's kernels return it contiguous (a view)
    return add_rms_norm(layer.post_attention_layernorm, hidden_states, attn.o_proj(out.reshape(1, t, -1)))


def mlp_forward(mlp, y: torch.Tensor) -> torch.Tensor:
    """down(act(gate(y)) * up(y)), gate and up in one GEMM where they share a copy."""
    if hasattr(mlp, "gate_up_proj"):  # one linear in the checkpoint (Phi-3's): gate then up, as HF chunks it
        gate, up = mlp.gate_up_proj(y).chunk(2, dim=-1)
    else:
        gate_up = fused_linears.project(mlp, y)
        gate, up = gate_up if gate_up is not None else (mlp.gate_proj(y), mlp.up_proj(y))
    native = isinstance(mlp.act_fn, torch.nn.SiLU) and (gate.dtype == torch.bfloat16 or getattr(mlp, C_GLUE, False))
    act = native_glue.silu_mul(gate[0], up[0]) if native else None
    act = mlp.act_fn(gate) * up if act is None else act.view(gate.shape)
    return mlp.down_proj(act)
