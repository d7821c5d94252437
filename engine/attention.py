"""Attention over the engine-owned paged KV cache, plugged into transformers' AttentionInterface.

The HF model runs unchanged on packed inputs (batch 1, all sequences' new tokens concatenated);
each attention layer lands here. For every layer we first write all new keys/values into the
cache, then attend: prefill per sequence (causal over its cached prefix + new tokens), decode
batched over gathered block tables. Writing before reading lets sequences scheduled in the same
step share prefix blocks that one of them is computing.

Decode is memory-bound on CPU: gathering every sequence's blocks costs as much as the attention
itself. So the runner sorts a decode batch by block count and cuts it into chunks of similar
length (padding stays small), the blocks are gathered with `index_select` into buffers reused by
every layer (no per-layer allocation and page faults), and the query heads that share a KV head
are laid out as query positions, which turns grouped-query attention into plain attention.
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
    # decode: chunks of the (length-sorted) batch that are attended together
    decode_chunks: list[DecodeChunk] | None = None
    gather_k: torch.Tensor | None = None  # [>= blocks gathered by the largest chunk, bs, kvh, d]
    gather_v: torch.Tensor | None = None
    # prefill with no cached prefix anywhere: one SDPA call over every packed token with this
    # block-diagonal causal mask [T, T] instead of one call per sequence (set by the runner on GPUs)
    packed_mask: torch.Tensor | None = None


@dataclass
class DecodeChunk:
    start: int  # rows [start, end) of the decode batch
    end: int
    blocks: torch.Tensor  # [(end - start) * num_blocks] block ids, row after row (padded with 0)
    num_blocks: int
    mask: torch.Tensor  # [end - start, 1, 1, num_blocks * block_size]: True where a key exists


_ctx: AttnContext | None = None


def set_context(ctx: AttnContext | None) -> None:
    global _ctx
    _ctx = ctx


def packed_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[T, T] bool, built on the segments' device: token i may attend token j when both lie in
    one sequence (segment id) and j <= i."""
    idx = torch.arange(segments.shape[0], device=segments.device)
    return (segments[:, None] == segments[None, :]) & (idx[None, :] <= idx[:, None])


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

    if ctx.is_prefill and ctx.packed_mask is not None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=ctx.packed_mask, scale=scaling,
                                             enable_gqa=gqa)
        return out.transpose(1, 2), None  # [1, T, H, d]
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

    # decode: one new token per sequence
    kvh, d = key.shape[1], key.shape[-1]
    q_all = query[0].transpose(0, 1)  # [B, H, d]
    outs = []
    for c in ctx.decode_chunks:
        b, length = c.end - c.start, c.num_blocks * k_cache.shape[1]
        k_buf, v_buf = ctx.gather_k[: b * c.num_blocks], ctx.gather_v[: b * c.num_blocks]
        torch.index_select(k_cache, 0, c.blocks, out=k_buf)
        torch.index_select(v_cache, 0, c.blocks, out=v_buf)
        k = k_buf.view(b, length, kvh, d).transpose(1, 2)  # [b, KVH, L, d]
        v = v_buf.view(b, length, kvh, d).transpose(1, 2)
        q = q_all[c.start : c.end].reshape(b, kvh, -1, d)  # the heads of a group as query positions
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask, scale=scaling))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.reshape(1, out.shape[0], -1, d), None  # [1, B, H, d]


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
