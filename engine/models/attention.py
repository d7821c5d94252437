"""Attention over the engine-owned paged KV cache: plugged into transformers' AttentionInterface
(`paged_attention`), or called by the fused decoder layers (`attend`, engine/models/fused_layers.py).

The model runs on packed inputs (batch 1, all sequences' new tokens concatenated). For every
layer we first write all new keys/values into the cache, then attend. Writing before reading
lets sequences scheduled in the same step share prefix blocks that one of them is computing,
and lets every path read keys from the cache alone.

Prefill: on the CPU every row through the decode kernel (batch invariance: a row's bits whatever cut its
prompt, and a decode row's; `_native_prefill`), or with batch_invariant off one SDPA call per sequence
(causal over its cached prefix + new tokens); on a GPU the step's spans padded into one call per layer
(`PaddedPrefill`).
Decode on the CPU: the C kernel of engine/kernels/native_decode.py, reading keys and values in place.
Elsewhere (a GPU, no C compiler, ROLLOUT_NATIVE_KERNELS=0): every row's blocks are gathered with
`index_select` into buffers reused by every layer and step, and the query heads that share a KV head are laid out as query positions, which turns
grouped-query attention into one plain masked call. The batch comes sorted by block count; on a
GPU it is one chunk, on the CPU (memory-bound) it is cut where padding costs more than a chunk
(engine/step_inputs.chunk_cuts).

A layer with a sliding window of W keys (Mistral's every layer, Qwen2's upper ones: the module's
`sliding_window`) gives each query its last W keys, as HF's mask does (key j of query i where
i - W < j <= i): the kernel from each row's first key in the window on, the torch paths by a mask.
A window's layers keep a cache of their own where they mix with full ones (engine/kv_groups.py: each
layer reads its group's slots and tables, `AttnContext.layer_ctx`); the blocks wholly behind a sequence's
window go back to the free list as it decodes (engine/block_manager.py, as vLLM's sliding-window manager
does), their table entries pointing at a spare block: the kernel starts past them, the masks leave them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.kernels import native_decode, native_glue
from engine.kernels.native_decode import NativeDecode

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
    # prefill as one batch (set by the runner on GPUs): the spans padded to one shape, keys and
    # values gathered from the cache (every span's prefix and new tokens), see PaddedPrefill
    padded_prefill: PaddedPrefill | None = None
    # per layer: the cache as blocks [num_blocks, bs, kvh, d] and as slots [num_slots, kvh, d]
    # (views made when the cache is allocated, so a step selects no layer)
    k_blocks: list[torch.Tensor] | None = None
    v_blocks: list[torch.Tensor] | None = None
    k_slots: list[torch.Tensor] | None = None
    v_slots: list[torch.Tensor] | None = None
    rope: tuple | None = None  # (cos, the layers' cos, sin with rotate_half's sign), see rope_tables
    span_masks: dict = field(default_factory=dict)  # prefill: (span index, window) -> its mask, made by the first layer
    # decode through the C kernel (engine/kernels/native_decode.py) instead of decode_chunks
    native: NativeDecode | None = None
    # per layer: the context of its KV cache group (engine/kv_groups.py: its slots, tables and their
    # chunks) where the layers keep two; None: this one serves every layer
    layer_ctx: list[AttnContext] | None = None


@dataclass
class DecodeChunk:
    start: int  # rows [start, end) of the decode batch
    end: int
    blocks: torch.Tensor  # [(end - start) * num_blocks] block ids, row after row (padded with 0)
    num_blocks: int
    # [end - start, 1, 1, num_blocks * block_size]: True where a key exists (on the CPU: 0 there and
    # -inf elsewhere, in the cache's dtype, which SDPA would otherwise make of a bool mask per call)
    mask: torch.Tensor
    # the gather buffers' slices this chunk fills ([rows * num_blocks, bs, kvh, d]) and the same
    # memory as keys/values [rows, kvh, num_blocks * bs, d]: made once per step, not per layer
    k_out: torch.Tensor | None = None
    v_out: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # [end - start] each row's keys: its mask under a sliding window
    windowed: dict = field(default_factory=dict)  # window -> that mask, made by the first layer with it


def decode_chunk(start: int, end: int, blocks: torch.Tensor, num_blocks: int, mask: torch.Tensor,
                 k_buf: torch.Tensor, v_buf: torch.Tensor, lengths: torch.Tensor | None = None) -> DecodeChunk:
    """Rows [start, end) attended at `num_blocks` blocks, gathering into the front of the gather
    buffers k_buf / v_buf [N, bs, kvh, d]; `mask` [rows, keys]; `lengths` the rows' key counts."""
    rows, (bs, kvh, d) = end - start, k_buf.shape[1:]
    k_out, v_out = k_buf[: rows * num_blocks], v_buf[: rows * num_blocks]
    return DecodeChunk(start, end, blocks, num_blocks, mask[:, None, None, :], k_out, v_out,
                       k_out.view(rows, num_blocks * bs, kvh, d).transpose(1, 2),
                       v_out.view(rows, num_blocks * bs, kvh, d).transpose(1, 2), lengths)


def _chunk_mask(c: DecodeChunk, window: int | None) -> torch.Tensor:
    """The chunk's mask [rows, 1, 1, keys], or under a sliding window its rows' last `window` keys'."""
    if not window:
        return c.mask
    mask = c.windowed.get(window)
    if mask is None:
        keys = torch.arange(c.k.shape[2], device=c.mask.device)
        mask = c.windowed[window] = as_mask(_window_keys(keys, c.lengths[:, None] - 1, window), c.mask.dtype)[
            :, None, None, :]
    return mask


def _window_keys(keys: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """True where key position `keys` is visible to query position `positions` (broadcast): causal, and
    under a sliding window within its last `window` keys (HF's mask: positions - window < keys)."""
    visible = keys <= positions
    return visible if not window else visible & (keys > positions - window)


def as_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as SDPA takes it here: bool, or (a float dtype, the CPU's) the additive 0 / -inf SDPA
    would make of it at every call."""
    if dtype == torch.bool:
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


@dataclass
class PaddedPrefill:
    """A prefill step as one attention call per layer, whatever its spans: S spans padded to
    Lq query rows and Lk keys (every span's blocks gathered; the new tokens are in the cache
    already). No [T, T] mask and no loop over spans: the GPU's path."""

    blocks: torch.Tensor  # [S * nb] block ids, span after span (padded with 0)
    rows: torch.Tensor  # [S * Lq] index of each padded query row into the packed tokens (pads: any)
    back: torch.Tensor  # [T] index of each packed token into the padded rows
    mask: torch.Tensor  # [S, 1, Lq, Lk] True where a query row may attend a key
    spans: int
    q_len: int
    num_blocks: int
    positions: torch.Tensor | None = None  # [S, 1, Lq, 1] each padded row's position: masks under a window
    windowed: dict = field(default_factory=dict)  # window -> its mask, made by the first layer with it

    def window_mask(self, window: int | None) -> torch.Tensor:
        if not window:
            return self.mask
        if window not in self.windowed:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.windowed[window] = _window_keys(keys, self.positions, window)
        return self.windowed[window]


_ctx: AttnContext | None = None


def cache_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per-layer views of the caches [layers, num_blocks, bs, kvh, d]: as blocks and as slots."""
    return {
        "k_blocks": list(k_cache.unbind(0)),
        "v_blocks": list(v_cache.unbind(0)),
        "k_slots": [k.flatten(0, 1) for k in k_cache.unbind(0)],
        "v_slots": [v.flatten(0, 1) for v in v_cache.unbind(0)],
    }


def grouped_cache_views(caches: list[tuple[torch.Tensor, torch.Tensor]], layer_group) -> dict[str, list[torch.Tensor]]:
    """Per-layer views (cache_views') of each KV cache group's caches [its layers, its blocks, bs, kvh, d],
    in layer order: layer i is the next of its group's (`layer_group[i]`)."""
    per = [cache_views(k, v) for k, v in caches]
    taken = [0] * len(caches)
    out = {name: [] for name in per[0]}
    for g in layer_group:
        for name, views in out.items():
            views.append(per[g][name][taken[g]])
        taken[g] += 1
    return out


def set_context(ctx: AttnContext | None) -> None:
    global _ctx
    _ctx = ctx


def _layer_context(layer: int) -> AttnContext:
    """The step's context as layer `layer` reads it: its KV cache group's."""
    ctx = _ctx
    assert ctx is not None, "paged attention called outside the engine's model runner"
    return ctx if ctx.layer_ctx is None else ctx.layer_ctx[layer]


def _prefill(ctx: AttnContext, layer: int, query, key, value, scaling, window: int | None = None) -> torch.Tensor:
    """Prefill attention, query [1, H, T, d], key/value [1, KVH, T, d] (written to the cache
    already): [1, H, T, d]. `window`: the layer's sliding window (None: full attention)."""
    gqa = query.shape[1] != key.shape[1]
    if ctx.native is not None:  # the CPU's kernel, each row as a decode row: see _native_prefill
        return _native_prefill(ctx, layer, query, scaling, window)
    if ctx.padded_prefill is not None:
        return _padded_prefill(ctx.padded_prefill, ctx.k_blocks[layer], ctx.v_blocks[layer], query, scaling, gqa,
                               window)
    k_cache, v_cache = ctx.k_blocks[layer], ctx.v_blocks[layer]
    outs = []
    for i, (start, end, computed, block_table) in enumerate(ctx.prefill_spans):
        q = query[:, :, start:end]
        if computed == 0 and (not window or end - start <= window):
            # nothing cached and no window cuts: attend to the fresh keys, exactly as HF's sdpa does
            out = F.scaled_dot_product_attention(
                q, key[:, :, start:end], value[:, :, start:end], is_causal=True, scale=scaling, enable_gqa=gqa
            )
        else:
            total = computed + end - start
            if computed == 0:  # a window cuts a fresh span: its own keys, masked
                k, v = key[:, :, start:end], value[:, :, start:end]
            else:
                k = _gather(k_cache, block_table, total).unsqueeze(0)
                v = _gather(v_cache, block_table, total).unsqueeze(0)
            mask = ctx.span_masks.get((i, window))
            if mask is None:
                mask = ctx.span_masks[i, window] = _causal_mask(end - start, total, computed, q.dtype, q.device,
                                                                window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        outs.append(out)
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _native_prefill(ctx: AttnContext, layer: int, query, scaling, window: int | None) -> torch.Tensor:
    """Prefill attention through the decode kernel (engine/kernels/native/paged_decode.c): every row
    attends its keys in the cache up to its own position, one row's sums in one fixed order. So a
    prompt row's bits do not depend on how its prompt was cut (whole, chunked, after a prefix-cache
    hit, or sharing the step with its own samples'), which SDPA's blocked kernel does not promise (a
    prefix hit at 80 or 129 tokens moved a bf16 logprob), and equal what the engine's exact trainer
    forward recomputes (engine/exact_logprobs.py). query [1, H, T, d] -> [1, H, T, d]."""
    q = query[0].transpose(0, 1)  # [T, H, d]
    out = native_decode.attend(ctx.native, q, ctx.k_blocks[layer], ctx.v_blocks[layer], scaling, window)
    if out is None:
        raise RuntimeError(f"the native attention kernel refused q {tuple(q.shape)} on a {ctx.k_cache.dtype} cache")
    return out.transpose(0, 1).unsqueeze(0)


def _causal_mask(rows: int, keys: int, computed: int, dtype, device, window: int | None = None) -> torch.Tensor:
    """Row i sees keys [0, computed + i] (under a sliding window, its last `window` of them): as a bool
    mask on a GPU; on the CPU as the additive mask (0 / -inf in the query's dtype)."""
    positions = torch.arange(computed, computed + rows, device=device)[:, None]
    visible = _window_keys(torch.arange(keys, device=device), positions, window)
    return as_mask(visible, torch.bool if device.type != "cpu" else dtype)


def _padded_prefill(p: PaddedPrefill, k_blocks, v_blocks, query, scaling, gqa, window=None) -> torch.Tensor:
    """query [1, H, T, d] -> [1, H, T, d], one SDPA over the padded spans."""
    h, d = query.shape[1], query.shape[-1]
    kvh, bs = k_blocks.shape[-2], k_blocks.shape[1]
    length = p.num_blocks * bs
    k = k_blocks.index_select(0, p.blocks).view(p.spans, length, kvh, d).transpose(1, 2)  # [S, kvh, Lk, d]
    v = v_blocks.index_select(0, p.blocks).view(p.spans, length, kvh, d).transpose(1, 2)
    q = query[0].index_select(1, p.rows).view(h, p.spans, p.q_len, d).transpose(0, 1)  # [S, H, Lq, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=p.window_mask(window), scale=scaling, enable_gqa=gqa)
    return out.transpose(0, 1).reshape(h, -1, d).index_select(1, p.back).unsqueeze(0)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] -> [kvh, length, d] for one sequence."""
    kv = cache[block_table].flatten(0, 1)[:length]
    return kv.transpose(0, 1)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx = _layer_context(module.layer_idx)
    # what this attention does not compute: refused, never ignored (Gemma 2's soft-capped scores, gpt-oss's sinks)
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attention with {name!r} (from {type(module).__name__}) is not supported "
                                      "by the paged engine")
    # HF's layers pass their window (None or 0: full attention), or hold it (Qwen2-MoE's sliding layers)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    layer = module.layer_idx
    # query [1, H, T, d]; key/value [1, KVH, T, d]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, d]
    ctx.k_slots[layer].index_copy_(0, ctx.slot_mapping, k_new)
    ctx.v_slots[layer].index_copy_(0, ctx.slot_mapping, v_new)
    if ctx.is_prefill:
        return _prefill(ctx, layer, query, key, value, scaling, window).transpose(1, 2), None  # [1, T, H, d]

    # decode: one new token per sequence
    q_all = query[0].transpose(0, 1)  # [B, H, d]
    out = _decode(ctx, layer, q_all, scaling, window)
    return out.reshape(1, q_all.shape[0], -1, q_all.shape[-1]), None  # [1, B, H, d]


def _decode(ctx: AttnContext, layer: int, q: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
    """Decode attention of q [B, H, d] (the keys already in the cache): [B, kvh, H / kvh, d]."""
    kvh, d = ctx.k_cache.shape[-2], q.shape[-1]
    if ctx.native is not None:
        out = native_decode.attend(ctx.native, q, ctx.k_blocks[layer], ctx.v_blocks[layer], scaling, window)
        if out is None:
            raise RuntimeError(f"the native decode kernel refused q {tuple(q.shape)} on a {ctx.k_cache.dtype} cache")
        return out.view(q.shape[0], kvh, -1, d)
    outs = []
    for c in ctx.decode_chunks:
        torch.index_select(ctx.k_blocks[layer], 0, c.blocks, out=c.k_out)
        torch.index_select(ctx.v_blocks[layer], 0, c.blocks, out=c.v_out)
        qc = q[c.start : c.end] if len(ctx.decode_chunks) > 1 else q
        qc = qc.reshape(c.end - c.start, kvh, -1, d)  # the heads of a group as query positions
        outs.append(F.scaled_dot_product_attention(qc, c.k, c.v, attn_mask=_chunk_mask(c, window), scale=scaling))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def rope_tables(position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's (cos, sin) [1, T, d] as [T, 1, d], sin with rotate_half's sign folded in (-1 on the
    first half): computed by the step's first layer, reused by the others."""
    cos, sin = position_embeddings
    ctx = _ctx
    if ctx.rope is None or ctx.rope[0] is not cos:
        t, d = cos.shape[-2:]
        sign = _rotate_sign(d, sin.dtype, sin.device)
        ctx.rope = (cos, cos.view(t, 1, d), sin.view(t, 1, d) * sign)
    return ctx.rope[1], ctx.rope[2]


_signs: dict = {}


def _rotate_sign(d: int, dtype, device) -> torch.Tensor:
    key = (d, dtype, str(device))
    if key not in _signs:
        sign = torch.ones(d, dtype=dtype, device=device)
        sign[: d // 2] = -1
        _signs[key] = sign
    return _signs[key]


def rotate_and_attend(layer: int, q, k, v, cos, sin_signed, scaling: float, rotate,
                      window: int | None = None) -> torch.Tensor:
    """The fused layers' attention of q [T, H, d], k and v [T, kvh, d] not yet rotated: on the CPU
    the rotation and the cache writes in one C call (native_glue.rope_cache, torch's bits), else
    `rotate(x, cos, sin_signed)` and `attend`. `window`: the layer's sliding window (None: none)."""
    ctx = _layer_context(layer)
    done = native_glue.rope_cache(q, k, v, cos, sin_signed, ctx.slot_mapping, ctx.k_slots[layer], ctx.v_slots[layer])
    if done is None:
        return attend(layer, rotate(q, cos, sin_signed), rotate(k, cos, sin_signed), v, scaling, window)
    return _attend_written(ctx, layer, done[0], done[1], v, scaling, window)


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           window: int | None = None) -> torch.Tensor:
    """The fused layers' attention (engine/models/fused_layers.py): q [T, H, d], k and v [T, kvh, d]
    of this step's tokens; writes k, v into the cache, returns [T, H * d]-shaped output."""
    ctx = _layer_context(layer)
    ctx.k_slots[layer].index_copy_(0, ctx.slot_mapping, k)
    ctx.v_slots[layer].index_copy_(0, ctx.slot_mapping, v)
    return _attend_written(ctx, layer, q, k, v, scaling, window)


def _attend_written(ctx: AttnContext, layer: int, q, k, v, scaling: float, window: int | None) -> torch.Tensor:
    if not ctx.is_prefill:
        return _decode(ctx, layer, q, scaling, window)
    out = _prefill(ctx, layer, q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                   v.transpose(0, 1).unsqueeze(0), scaling, window)
    return out.transpose(1, 2)[0].reshape(q.shape[0], -1)


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
