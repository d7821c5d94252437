"""Mixtures of experts (qwen3_moe, qwen2_moe, mixtral, olmoe) on the engine's own modules, beside
the dense families of engine/models/llama_model.py and built the same way: no transformers import, HF's
parameters under transformers 5's names (each layer's experts as two 3-D tensors,
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], what a trainer's
`named_parameters()` holds), so pushes, checksums and host copies see the trainer's model.

A checkpoint's per-expert tensors (`mlp.experts.3.up_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w3.weight`) are stacked into those at load (engine/models/expert_names.py).

The attention is the dense layers' (engine/models/fused_layers.attention_block, with qwen3's per-head or
olmoe's full-width q/k norms); the sparse MLP routes each token to its top-k experts and runs each
active expert once a step over the tokens routed to it (engine/kernels/moe_experts.py), in HF's order, so
fp32 greedy output is HF's token for token. Each sparse block keeps the expert ids it chose for the
step's tokens (`last_ids`, [T, k]): what a request asking for its routed experts gets back.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import moe_experts
from engine.models import expert_names, fused_layers, llama_model

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def is_moe(cfg) -> bool:
    return getattr(cfg, "model_type", None) in ARCHS


def moe_fields(cfg: SimpleNamespace) -> SimpleNamespace:
    """What each family's config says of its experts, under one set of names."""
    t = cfg.model_type
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts")
    inter = cfg.moe_intermediate_size if t in ("qwen3_moe", "qwen2_moe") else cfg.intermediate_size
    sparse_step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    return SimpleNamespace(
        experts=experts, top_k=cfg.num_experts_per_tok, intermediate=inter,
        norm_topk=True if t == "mixtral" else bool(getattr(cfg, "norm_topk_prob", False)),
        scores_fp32=t == "mixtral",  # Mixtral's router keeps its weights in fp32; the others cast back
        shared=getattr(cfg, "shared_expert_intermediate_size", 0) if t == "qwen2_moe" else 0,
        sparse=[i not in dense and (i + 1) % sparse_step == 0 for i in range(cfg.num_hidden_layers)],
    )


def unsupported(model_dir: str, max_model_len: int | None = None) -> str | None:
    """Why this directory needs transformers' modelling code (None: it does not)."""
    why = llama_model.unsupported(model_dir, ARCHS, max_model_len)
    if why is not None:
        return why
    cfg = llama_model.read_config(model_dir)
    if getattr(cfg, "clip_qkv", None) is not None:
        return "clipped q/k/v (olmoe's clip_qkv)"
    return None


class Router(nn.Module):
    """The router's logits on its weight as it is (never a derived copy: the routing must be the
    one a trainer's model makes): in C where the experts run in C (moe_experts.router_logits, the
    C decode loop's too, so both forwards route alike), else F.linear as HF's router."""

    def __init__(self, hidden: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        done = moe_experts.router_logits(x, self.weight)
        return F.linear(x, self.weight) if done is None else done


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))
        self.act_fn = nn.SiLU()


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: SimpleNamespace, moe: SimpleNamespace):
        super().__init__()
        self.top_k, self.norm_topk, self.scores_fp32 = moe.top_k, moe.norm_topk, moe.scores_fp32
        experts = Experts(moe.experts, cfg.hidden_size, moe.intermediate)
        if cfg.model_type == "qwen3_moe":  # HF's order of registration, so named_parameters() lists as HF's
            self.experts = experts
        self.gate = Router(cfg.hidden_size, moe.experts)
        self.experts = experts
        if moe.shared:
            self.shared_expert = llama_model.MLP(SimpleNamespace(hidden_size=cfg.hidden_size,
                                                                 intermediate_size=moe.shared))
            self.shared_expert_gate = Router(cfg.hidden_size, 1)
        self.last_ids: torch.Tensor | None = None  # [T, k], the step's choices (routing replay)
        self.batch_invariant = True  # EngineConfig.batch_invariant (set by the loader): moe_experts.block_native's

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """y [1, T, H], normed: the experts' weighted sum (plus the gated shared expert's output)."""
        x = y.view(-1, y.shape[-1])
        shared = fused_layers.mlp_forward(self.shared_expert, y).view_as(x) if hasattr(self, "shared_expert") else None
        e, logits = self.experts, self.gate(x)
        done = moe_experts.block_native(x, logits, self.top_k, self.norm_topk, self.scores_fp32, e.gate_up_proj,
                                        e.down_proj, self.batch_invariant, moe_experts.served_panels(e)
                                        ) if isinstance(e.act_fn, nn.SiLU) else None
        if done is None:
            weights, ids = moe_experts.route(logits, self.top_k, self.norm_topk, self.scores_fp32)
            done = moe_experts.run(x, ids, weights, e.gate_up_proj, e.down_proj, e.act_fn), ids
        out, self.last_ids = done
        if shared is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out.view_as(y)


class DecoderLayer(nn.Module):
    # its forward is the fused layers' attention and an MLP (dense, or sparse as SparseMoeBlock runs
    # it), which the C decode loop runs alike (engine/models/native_layers.py)
    C_DECODE_LOOP = True

    def __init__(self, cfg: SimpleNamespace, layer_idx: int):
        super().__init__()
        moe = moe_fields(cfg)
        self.self_attn = llama_model.Attention(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg, moe) if moe.sparse[layer_idx] else llama_model.MLP(cfg)
        self.input_layernorm = llama_model.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = llama_model.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, **_) -> torch.Tensor:
        h, y = fused_layers.attention_block(self, hidden_states, position_embeddings)
        mlp = self.mlp
        return h + (mlp(y) if isinstance(mlp, SparseMoeBlock) else fused_layers.mlp_forward(mlp, y))


def load(model_dir: str, dtype: torch.dtype, max_model_len: int | None = None) -> llama_model.CausalLM | None:
    """The model with its checkpoint's weights in `dtype` (per-expert tensors stacked); None when
    the checkpoint's names do not fit it."""
    return llama_model.load(model_dir, dtype, DecoderLayer, expert_names.fuse_checkpoint, max_model_len)


def sparse_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's sparse MLPs in layer order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
