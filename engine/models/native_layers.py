"""A decode step's decoder layers in one C call (engine/kernels/native/decode_layers.c), where every
kernel of engine/models/fused_layers.py's forward is native: in bf16, AMX or AVX512-BF16 linears (bf16,
or weight-only int8, which runs on AVX2 too) or, on AVX2, f32_linear.c on the weights' bf16 panels (input
widened, output rounded), the rotation and cache writes, decode attention, the norms (Qwen3's per-head q/k
norms too) and silu * up;
in fp32, the linears on engine/kernels/native/f32_linear.c (AVX-512 or AVX2) and the same glue in fp32.

Driven from Python, a 32-sequence bf16 decode step on 2 cores spent about a third of its main
thread's time between those kernels (torch's dispatch, views, module calls), with the other core
idle meanwhile. The C loop calls the same kernels in the same order on the same values, through
the addresses of the functions loaded here, so in bf16 its output has the Python forward's bits
(tested). In fp32 its norm and silu are C's where Python runs torch's (an ulp or so apart a value):
the fp32 engine's tests hold it to HF's greedy tokens and, within the bound derived from fp32's
rounding, to HF's logprobs, as they hold the Python forward.

It runs only where all of that holds for the step; anything else (a prefill, a linear on oneDNN,
a bias outside q/k/v, a LoRA hook on any module of a layer, gradients, no C
compiler, ROLLOUT_NATIVE_LAYERS=0) keeps the Python forward, which is the reference. The weights' copies
are looked up per step through derived_weights, so a push's copies serve from the first step
after its commit, as they do in Python.
"""

from __future__ import annotations

import ctypes
import os

import torch

from engine.kernels import (amx_linears, bf16_rows, derived_weights, f32_linears, int8_linears, moe_experts,
                            native_kernels, w8_linears)
from engine.models import attention, fused_layers

ENV_SWITCH = "ROLLOUT_NATIVE_LAYERS"
_PTR = ctypes.c_void_p
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _kernel_names(dtype: torch.dtype) -> tuple:
    """Kernels' fields in decode_layers.c, (library, symbol) each: the linears, then the loop's dtype's."""
    x = _SUFFIX[dtype]
    w8_bf16, w8_f32 = w8_linears.c_kernels()
    return (("amx_linear", "amx_linear_bf16"), w8_bf16, ("f32_linear", "f32_linear"), w8_f32, bf16_rows.c_kernel(),
            ("f32_linear", "f32_linear_rows"), ("f32_linear", "f32_linear_bf16_panels"),
            ("f32_linear", "f32_linear_rows_bf16"),
            ("layer_glue", f"rope_cache_{x}"),
            ("layer_glue", f"add_rms_norm_{x}"), ("layer_glue", f"silu_mul_{x}"), ("paged_decode", f"paged_decode_{x}"),
            ("layer_glue", f"gemma_norm_{x}"), ("layer_glue", f"gelu_tanh_mul_{x}"))


LAYER_FIELDS = 35  # Layer in decode_layers.c: two norms, four (weight, kind, bias), two caches, q/k norms, 10 MoE,
# the sliding window, Gemma's two MLP norms, the layer's rope tables, its KV cache group's slots and block table
MOE_FIELDS = 10  # moe, router, experts_gate_up, experts_down, experts, top_k, expert_width, norm_topk, weights_f32, ids
_MOE_KERNELS = 3  # Kernels' moe_block, moe_kernels, router_logits: set per call for a model with sparse MLPs
# Linear.kind (F32_BF16: the fp32 kernel's bf16 panels; F32_BF16_ROWS: its bf16 weights read in place)
BF16, W8, F32, BF16_ROWS, F32_ROWS, F32_BF16, F32_BF16_ROWS = 0, 1, 2, 3, 4, 5, 6
# the linears each loop takes: a bf16 loop takes the fp32 kernel's too (a CPU without bf16 kernels: AVX2)
_KINDS = {torch.bfloat16: (BF16, W8, BF16_ROWS, F32, F32_BF16, F32_BF16_ROWS), torch.float32: (F32, W8, F32_ROWS)}


class _Shape(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("layers", "T", "hidden", "heads", "kv_heads", "head_dim",
                                               "intermediate", "block_size", "max_len", "table_stride", "gemma",
                                               "rotary")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


_SCRATCH = ("x", "qkv", "q", "k", "attn", "o", "h", "h2", "gate_up", "act", "down", "x16")
_MOE_SCRATCH = ("logits", "xg", "gu", "eact", "dn", "inv", "order", "ends", "pick_weights")


class _Scratch(ctypes.Structure):
    _fields_ = [(n, _PTR) for n in _SCRATCH + _MOE_SCRATCH]


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "off", "false", "no")


_kernels_cache: dict = {}


def _kernels(dtype: torch.dtype):
    """(the loop's entry, the kernels' addresses: Kernels in decode_layers.c) for `dtype`, or None
    where a kernel it needs does not run here."""
    if dtype not in _kernels_cache:
        names = _kernel_names(dtype)
        libs = {name: native_kernels.library(name) for name in {lib for lib, _ in names}}
        entry = native_kernels.function("decode_layers", f"decode_layers_{_SUFFIX[dtype]}", (_PTR,) * 9,
                                        ctypes.c_int)
        ok = entry is not None and all(libs.values())  # each layer's copies say which linears run (_copy)
        table = (ctypes.c_int64 * (len(names) + _MOE_KERNELS))(
            *[ctypes.cast(getattr(libs[lib], sym), _PTR).value for lib, sym in names]) if ok else None
        _kernels_cache[dtype] = (entry, table) if ok else None
    return _kernels_cache[dtype]


def reset() -> None:
    """Forget the loaded kernels (with native_kernels.reset)."""
    _kernels_cache.clear()


native_kernels.forget_with_kernels(reset)


def _copy(linear: torch.nn.Module, group) -> tuple[int, int, int, int] | None:
    """(address, kind, n, k) of the copy serving `linear` (its group's when it has one), or None when
    it is not one of the loop's kernels'."""
    copy = derived_weights.current_group(group) if group is not None else derived_weights.current(linear)
    if isinstance(copy, derived_weights.WeightRows):
        if copy.dtype == torch.float32:
            return copy.desc.data_ptr(), F32_ROWS, copy.n, copy.k
        owner = group.members[0] if group is not None else linear
        on_f32 = getattr(owner, "_packed_dtype", None) == torch.float32  # bf16 rows on the fp32 kernel (AVX2)
        return copy.desc.data_ptr(), F32_BF16_ROWS if on_f32 else BF16_ROWS, copy.n, copy.k
    if isinstance(copy, amx_linears.AmxWeight) and copy.packed.dtype == torch.bfloat16:
        return copy.packed.data_ptr(), BF16, copy.n, copy.k
    if isinstance(copy, f32_linears.F32Weight):
        return copy.packed.data_ptr(), F32_BF16 if copy.packed.dtype == torch.bfloat16 else F32, copy.n, copy.k
    amx = getattr(copy, "packed", None)
    if getattr(copy, "kernel", None) in int8_linears.WEIGHT_ONLY and isinstance(amx, amx_linears.AmxWeight):
        return amx.packed.data_ptr(), W8, amx.n, amx.k
    return None


def _hooked(module: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def is_sparse(mlp) -> bool:
    """Whether `mlp` is a sparse block (engine/models/moe_model.SparseMoeBlock: a router and 3-D experts)."""
    return hasattr(mlp, "gate") and hasattr(mlp, "experts")


def _sparse_fields(mlp, shape: dict, t: int, routed: list) -> list[int] | None:
    """A sparse MLP's MOE_FIELDS (its expert ids [t, k] made here, added to `routed` with it), or None when
    the C block does not take it (a shared expert, another activation, shapes its kernels refuse)."""
    e, dtype = mlp.experts, shape["dtype"]
    weights = (mlp.gate.weight, e.gate_up_proj, e.down_proj)
    if (hasattr(mlp, "shared_expert") or not isinstance(e.act_fn, torch.nn.SiLU)
            or not all(w.dtype == dtype and w.is_contiguous() and w.device.type == "cpu" for w in weights)
            or not moe_experts.fits(shape["hidden"], e.down_proj.shape[2], dtype)
            or (e.gate_up_proj.shape[0], mlp.top_k, e.down_proj.shape[2]) != (shape["experts"], shape["top_k"],
                                                                              shape["expert_width"])):
        return None  # (the step's scratch is sized once, by the first sparse block's sizes)
    on_panels = moe_experts.served_panels(e)  # the experts' copies as panels, where they run on them
    if (on_panels is not None) != shape["expert_panels"]:
        return None  # (the step's kernel table is one for every sparse block)
    ids = torch.empty(t, mlp.top_k, dtype=torch.int64)
    routed.append((mlp, ids))
    weights = weights[:1] + (on_panels or weights[1:])
    return [1, *(w.data_ptr() for w in weights), e.gate_up_proj.shape[0], mlp.top_k, e.down_proj.shape[2],
            int(mlp.norm_topk), int(mlp.scores_fp32 and dtype != torch.float32), ids.data_ptr()]


def _projections(attn, mlp, sparse: bool) -> tuple:
    """(q/k/v, gate/up) as (linear, group): one linear in the checkpoint (Phi-3's qkv_proj and gate_up_proj)
    or fused_linears' group of the three (two) serving one copy (None: not grouped); then the q/k/v linears,
    and the layer's other linears."""
    if hasattr(attn, "qkv_proj"):
        qkv, qkv_linears = (attn.qkv_proj, None), (attn.qkv_proj,)
    else:
        qkv, qkv_linears = (None, getattr(attn, "_fused", None)), (attn.q_proj, attn.k_proj, attn.v_proj)
    if sparse:
        return qkv, None, qkv_linears, (attn.o_proj,)
    if hasattr(mlp, "gate_up_proj"):
        return qkv, (mlp.gate_up_proj, None), qkv_linears, (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return qkv, (None, getattr(mlp, "_fused", None)), qkv_linears, (attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                                                    mlp.down_proj)


def _layer_plan(layer, shape: dict):
    """What a layer's row takes from its modules, made once per layer and dtype (a step's rows were 3-4%
    of a 1.5B model's 32-sequence bf16 step, mostly walking the modules and their attributes): its modules
    (for their hooks), norms, and its linears as (linear, group, n, k), q/k/v's first; or None when some
    part of it must run in Python whatever the step. Only the modules' structure is kept: the copies, the
    bias and the norms' storage are read each step (a push may change any of them)."""
    cached = getattr(layer, "_native_plan", None)
    if cached is not None and cached[0] == (shape["dtype"], shape["eps"]):
        return cached[1]
    attn, mlp = layer.self_attn, layer.mlp
    sparse = is_sparse(mlp)
    qkv, gate_up, qkv_linears, others = _projections(attn, mlp, sparse)
    qk_norm = getattr(attn, "qk_norm", None)
    norms = (layer.input_layernorm, layer.post_attention_layernorm, *((attn.q_norm, attn.k_norm) if qk_norm else ()),
             *((layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) if shape["gemma"] else ()))
    h, q, kv, i = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"], \
        shape["intermediate"]
    plan = None
    if (qkv != (None, None) and (sparse or gate_up != (None, None))
            and not any(m.bias is not None for m in others)
            and all(hasattr(m, "_derive") for m in (*qkv_linears, *others))
            # q/k/v biases (qwen2's) are taken; no other layer has them
            and qk_norm in (None, "head")  # a norm over the whole projection (olmoe's) is not the loop's
            and not any(n.weight.dtype != shape["dtype"] or _eps(n) != shape["eps"] for n in norms)):
        mlp_linears = () if sparse else ((*gate_up, 2 * i, h), (mlp.down_proj, None, h, i))
        qkv_bias = tuple(m.bias for m in qkv_linears) if qkv_linears[0].bias is not None else None
        plan = (tuple(layer.modules()), norms, sparse, qkv_bias,
                ((*qkv, q + 2 * kv, h), (attn.o_proj, None, h, q), *mlp_linears))
    layer._native_plan = ((shape["dtype"], shape["eps"]), plan)
    return plan


def _eps(norm) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps  # Llama's name, Gemma's


def _layer_row(layer, ctx, index: int, shape: dict, keep: list, routed: list, t: int,
               rope: tuple = (0, 0)) -> list[int] | None:
    """The layer's row of LAYER_FIELDS, or None when some part of it must run in Python; `keep`
    holds the tensors made for it (its q/k/v bias) until the call, `routed` a sparse MLP's (block,
    expert ids [t, k]); `rope` the addresses of the layer's own rope tables (0, 0: the call's)."""
    plan = _layer_plan(layer, shape)
    if plan is None:
        return None
    modules, norms, sparse, qkv_bias, linears = plan
    if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
        return None
    dtype = shape["dtype"]
    row = [norms[0].weight.data_ptr(), norms[1].weight.data_ptr()]
    for position, (linear, group, n, k) in enumerate(linears):
        copy = _copy(linear, group)
        if copy is None or copy[2:] != (n, k) or copy[1] not in _KINDS[dtype]:
            return None
        bias = 0
        if position == 0 and qkv_bias:  # (added after a weight-only int8 kernel's rounding, as in Python)
            b = torch.cat(qkv_bias).to(dtype)
            keep.append(b)
            bias = b.data_ptr()
        row += [*copy[:2], bias]
    k_cache, v_cache = ctx.k_blocks[index], ctx.v_blocks[index]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    if sparse:
        row += [0, 0, 0] * 2  # no gate_up, no down: the sparse fields below
    heads = [norms[2].weight.data_ptr(), norms[3].weight.data_ptr()] if len(norms) >= 4 else [0, 0]
    mlp_norms = [norms[4].weight.data_ptr(), norms[5].weight.data_ptr()] if len(norms) == 6 else [0, 0]
    moe = _sparse_fields(layer.mlp, shape, t, routed) if sparse else [0] * MOE_FIELDS
    if moe is None:
        return None
    window = getattr(layer.self_attn, "sliding_window", None) or 0
    group = ctx if ctx.layer_ctx is None else ctx.layer_ctx[index]  # its KV cache group's slots and table
    slots, table = group.slot_mapping, group.native.block_table
    if (table.shape != ctx.native.block_table.shape or table.stride() != ctx.native.block_table.stride()
            or slots.dtype != torch.int64 or not slots.is_contiguous()):
        return None
    return row + [k_cache.data_ptr(), v_cache.data_ptr(), *heads, *moe, window, *mlp_norms, *rope,
                  slots.data_ptr(), table.data_ptr()]


def _shape(model, dtype: torch.dtype) -> dict | None:
    """The model's sizes, or None when it is not one this runs (its layers not fused_layers')."""
    layers = model.layers
    if not len(layers) or any(getattr(layer.forward, "__func__", None) is not fused_layers._layer_forward
                              and not getattr(type(layer), "C_DECODE_LOOP", False) for layer in layers):
        return None
    attn = layers[0].self_attn
    gemma = bool(getattr(type(layers[0]), "GEMMA", False))
    fused = hasattr(attn, "qkv_proj")  # Phi-3's
    q = attn.qkv_proj if fused else attn.q_proj
    q_rows, kv_rows = attn.qkv_sizes[:2] if fused else (q.weight.shape[0], attn.k_proj.weight.shape[0])
    dense = [layer.mlp for layer in layers if not is_sparse(layer.mlp)]
    sparse = [layer.mlp for layer in layers if is_sparse(layer.mlp)]
    intermediate = 0
    if dense:
        mlp = dense[0]
        intermediate = (mlp.gate_up_proj.weight.shape[0] // 2 if hasattr(mlp, "gate_up_proj")
                        else mlp.gate_proj.weight.shape[0])
    return {"hidden": q.weight.shape[1], "heads": q_rows // attn.head_dim, "kv_heads": kv_rows // attn.head_dim,
            "head_dim": attn.head_dim, "intermediate": intermediate, "eps": _eps(model.norm),
            "scale": attn.scaling, "dtype": dtype, "gemma": gemma,
            # the sparse MLPs' sizes (one for all: a model's sparse layers are alike), for their scratch
            "experts": sparse[0].experts.gate_up_proj.shape[0] if sparse else 0,
            "top_k": sparse[0].top_k if sparse else 0,
            "expert_width": sparse[0].experts.down_proj.shape[2] if sparse else 0,
            "expert_panels": bool(sparse) and hasattr(sparse[0].experts, "gate_up_panels")}  # attach_panels'


def _scratch_bytes(shape: dict, t: int, dtype: torch.dtype, sparse: bool) -> dict[str, int]:
    """The bytes of each of the step's scratch buffers (decode_layers.c's scratch struct) for `t` rows;
    a sparse MLP's too where the model has one."""
    h, d, i = shape["hidden"], shape["heads"] * shape["head_dim"], shape["intermediate"]
    kv = shape["kv_heads"] * shape["head_dim"]
    widths = {"x": h, "qkv": d + 2 * kv, "q": d, "k": kv, "attn": d, "o": h, "h": h, "h2": h, "gate_up": 2 * i,
              "act": i, "down": h, "x16": max(h, d, i)}
    size = torch.finfo(dtype).bits // 8
    nbytes = {name: t * widths[name] * (2 if name == "x16" else size) for name in _SCRATCH}
    if sparse:
        picks, e, w = t * shape["top_k"], shape["experts"], shape["expert_width"]
        nbytes.update({"logits": t * e * size, "xg": picks * h * size, "gu": picks * 2 * w * size,
                       "eact": picks * w * size, "dn": picks * h * size, "inv": picks * 8, "order": picks * 8,
                       "ends": e * 8, "pick_weights": picks * 4})
    return nbytes


def _scratch(model, nbytes: dict[str, int]) -> tuple[torch.Tensor, _Scratch]:
    """One buffer holding each of `nbytes`' parts from a 64-byte boundary, and their addresses (the
    buffer must outlive the call). The model keeps the buffer for its next steps, grown when a step
    needs more: a fresh one each step was fresh pages each step (megabytes at 256 rows, past malloc's
    mmap threshold), and zeroing them was 1-2% of an MoE decode step."""
    total = sum(-(-b // 64) * 64 for b in nbytes.values())
    buffer = getattr(model, "_decode_scratch", None)
    if buffer is None or buffer.numel() < total:
        buffer = model._decode_scratch = torch.empty(total, dtype=torch.uint8)
    pointers, offset = {}, 0
    for name, size in nbytes.items():
        pointers[name] = buffer.data_ptr() + offset
        offset += -(-size // 64) * 64
    return buffer, _Scratch(**pointers)


def decode(model, hidden: torch.Tensor, position_embeddings) -> torch.Tensor | None:
    """The decoder model's layers and final norm over `hidden` [1, T, H] (the step's embeddings,
    overwritten) at a decode step: the normed hidden states, or None when Python must run them."""
    ctx = attention._ctx
    dtype = hidden.dtype
    if (ctx is None or ctx.is_prefill or ctx.native is None or dtype not in _SUFFIX or torch.is_grad_enabled()
            or not enabled()):
        return None
    loaded = _kernels(dtype)
    shape = _shape(model, dtype)
    if loaded is None or shape is None or model.norm.weight.dtype != dtype or _hooked(model.norm):
        return None
    t = hidden.shape[1]
    nd, slots = ctx.native, ctx.slot_mapping
    if (nd.block_table.shape[0] != t or not hidden.is_contiguous() or slots.dtype != torch.int64
            or not slots.is_contiguous()):
        return None
    keep = []
    if shape["gemma"]:  # a rope per layer kind (position_embeddings: their dict), each layer's in its row
        tables = {kind: attention.rope_tables(pe) for kind, pe in position_embeddings.items()}
        if any(c.dtype != dtype or not (c.is_contiguous() and s.is_contiguous()) for c, s in tables.values()):
            return None
        keep.extend(tables.values())
        position_embeddings = position_embeddings["full_attention"]
    rows, sparse = [], []
    for index, layer in enumerate(model.layers):
        rope = (0, 0)
        if shape["gemma"]:
            cos_l, sin_l = tables[layer.self_attn.layer_type]
            rope = (cos_l.data_ptr(), sin_l.data_ptr())
        row = _layer_row(layer, ctx, index, shape, keep, sparse, t, rope)
        if row is None:
            return None
        rows.append(row)
    if sparse:
        moe = moe_experts.loop_kernels(dtype, getattr(sparse[0][0], "batch_invariant", True), shape["expert_panels"])
        if moe is None:
            return None
        loaded[1][-_MOE_KERNELS:] = list(moe)
    cos, sin_signed = attention.rope_tables(position_embeddings)
    rotary = cos.shape[-1]  # a head's rotated values: its head_dim, or fewer (Phi-4-mini's partial rotary)
    if (cos.dtype != dtype or not (cos.is_contiguous() and sin_signed.is_contiguous()) or rotary % 2
            or rotary > shape["head_dim"]):
        return None
    entry, kernels = loaded
    table = torch.tensor(rows, dtype=torch.int64)
    bs = ctx.k_blocks[0].shape[1]
    s = _Shape(layers=len(rows), T=t, block_size=bs, max_len=nd.max_len, table_stride=nd.block_table.stride(0),
               gemma=int(shape["gemma"]), rotary=rotary,
               **{k: shape[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "eps", "scale")})
    buffer, scratch = _scratch(model, _scratch_bytes(shape, t, dtype, bool(sparse)))  # buffer: alive through the call
    rc = entry(ctypes.addressof(kernels), table.data_ptr(), ctypes.addressof(s), model.norm.weight.data_ptr(),
               cos.data_ptr(), sin_signed.data_ptr(), nd.lengths.data_ptr(), ctypes.addressof(scratch),
               hidden.data_ptr())
    if rc != 0:
        raise RuntimeError(f"decode_layers_{_SUFFIX[dtype]} failed ({rc}): out of memory, or a shape its kernels refuse")
    for mlp, ids in sparse:
        mlp.last_ids = ids  # the step's routed experts, as the Python block keeps them
    return hidden
