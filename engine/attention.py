"""Attention over the engine-owned paged KV cache, plugged into transformers' AttentionInterface.

The HF model runs unchanged on packed inputs (batch 1, all sequences' new tokens concatenated);
each attention layer lands here. For every layer we first write all new keys/values into the
cache, then attend: prefill per sequence (causal over its cached prefix + new tokens), decode
batched over gathered block tables. Writing before reading lets sequences scheduled in the same
step share prefix blocks that one of them is computing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_NAME = "rollout_paged"


@dataclass
class AttnContext:
    is_prefill: bool
    k_cache: torch.Tensor  # [layers, num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    # prefill: per sequence (start, end) in the packed batch, computed-prefix length, block table
    prefill_spans: list[tuple[int, int, int, torch.Tensor | None]] | None = None
    # decode: [B, max_blocks] block tables and [B] context lengths (incl. the new token)
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks*block_size]


_ctx: AttnContext | None = None


def set_context(ctx: AttnContext | None) -> None:
    global _ctx
    _ctx = ctx


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] -> [kvh, length, d] for one sequence."""
    kv = cache[block_table].flatten(0, 1)[:length]
    return kv.transpose(0, 1)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx = _ctx
    assert ctx is not None, "paged attention called outside the engine's model runner"
    if kwargs.get("sliding_window"):
        raise NotImplementedError("sliding-window attention is not supported by the paged engine")
    layer = module.layer_idx
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    # query [1, H, T, d]; key/value [1, KVH, T, d]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, d]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, ctx.slot_mapping, k_new)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, ctx.slot_mapping, v_new)
    gqa = query.shape[1] != key.shape[1]

    if ctx.is_prefill:
        outs = []
        for start, end, computed, block_table in ctx.prefill_spans:
            q = query[:, :, start:end]
            if computed == 0:  # nothing cached: attend to the fresh keys, exactly as HF's sdpa does
                out = F.scaled_dot_product_attention(
                    q, key[:, :, start:end], value[:, :, start:end], is_causal=True, scale=scaling, enable_gqa=gqa
                )
            else:
                total = computed + end - start
                k = _gather(k_cache, block_table, total).unsqueeze(0)
                v = _gather(v_cache, block_table, total).unsqueeze(0)
                mask = torch.ones(end - start, total, dtype=torch.bool, device=q.device).tril(computed)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
            outs.append(out)
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        return out.transpose(1, 2), None  # [1, T, H, d]

    # decode: one new token per sequence; gather each sequence's blocks into a padded batch
    b = ctx.block_tables.shape[0]
    k = k_cache[ctx.block_tables].flatten(1, 2).transpose(1, 2)  # [B, KVH, L, d]
    v = v_cache[ctx.block_tables].flatten(1, 2).transpose(1, 2)
    q = query[0].transpose(0, 1).unsqueeze(2)  # [B, H, 1, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.decode_mask, scale=scaling, enable_gqa=gqa)
    return out.view(b, -1, out.shape[-1]).unsqueeze(0), None  # [1, B, H, d]


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
