"""engine/kernels/moe_experts.py and engine/models/expert_names.py: the router's choice, the grouping of picks by
expert in HF's order, and the per-expert names of checkpoints against transformers 5's fused ones."""

import pytest
import torch

from engine.kernels import amx_linears, bf16_rows, f32_linears, moe_experts
from engine.models import expert_names


def test_route_renormalises_the_top_k_only_when_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = moe_experts.route(logits, 2, norm_topk=False, scores_fp32=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]] and torch.allclose(w, p[:, [1, 2]])
    w, _ = moe_experts.route(logits, 2, norm_topk=True, scores_fp32=False)
    assert torch.allclose(w.sum(-1), torch.ones(1))
    w, _ = moe_experts.route(logits.bfloat16(), 2, norm_topk=True, scores_fp32=True)
    assert w.dtype == torch.float32
    assert moe_experts.route(logits.bfloat16(), 2, True, False)[0].dtype == torch.bfloat16


def test_groups_sort_picks_by_expert_keeping_token_order():
    ids = torch.tensor([[2, 0], [0, 2], [3, 0]])  # tokens x slots; pick i * 2 + j
    order, ends = moe_experts.groups(ids, 5)
    assert order.tolist() == [1, 2, 5, 0, 3, 4] and ends.tolist() == [3, 3, 5, 6, 6]


def test_run_is_the_weighted_sum_of_each_tokens_experts():
    """Against the sum in fp64, within fp32's error: each GEMM's output within (its length + 1) roundings
    of the sum of its products' magnitudes, carried through the silu (|silu(g)| <= |g|, slope <= 1.1)."""
    g = torch.Generator().manual_seed(0)
    e, h, i, t, k = 5, 8, 6, 7, 2
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x = torch.randn(t, h, generator=g)
    weights, ids = moe_experts.route(torch.randn(t, e, generator=g), k, True, False)
    got = moe_experts.run(x, ids, weights, gate_up, down, torch.nn.functional.silu).double()
    silu, u = torch.nn.functional.silu, 2.0**-24
    for tok in range(t):
        want, mag = 0.0, 0.0
        for s in range(k):
            gu, dn, xx = gate_up[ids[tok, s]].double(), down[ids[tok, s]].double(), x[tok].double()
            act = silu(gu[:i] @ xx) * (gu[i:] @ xx)
            want = want + weights[tok, s].double() * (dn @ act)
            pre = gu.abs() @ xx.abs()  # bounds |gate|, |up| and their errors' scale
            mag = mag + weights[tok, s].double() * (dn.abs() @ (1.1 * pre[:i] * pre[i:]))
        bound = (2 * (h + 1) + i + 4) * u * mag
        assert ((got[tok] - want).abs() <= bound).all()


def test_per_expert_names_are_blocks_of_the_fused_tensors():
    p = expert_names.expert_part("model.layers.3.mlp.experts.5.up_proj.weight")
    assert p == ("model.layers.3.mlp.experts.gate_up_proj", 5, "up")
    assert expert_names.expert_part("model.layers.0.block_sparse_moe.experts.1.w2.weight") == (
        "model.layers.0.mlp.experts.down_proj", 1, "down")
    assert expert_names.expert_part("model.layers.0.mlp.gate.weight") is None
    assert expert_names.fused_name("model.layers.2.block_sparse_moe.gate.weight") == "model.layers.2.mlp.gate.weight"
    fused = torch.arange(2 * 6 * 3.0).view(2, 6, 3)
    assert torch.equal(expert_names.block(fused, p._replace(expert=1)), fused[1, 3:])
    assert expert_names.block(fused, p._replace(expert=1, part="gate")).is_contiguous()


def test_fuse_checkpoint_stacks_gate_then_up_and_keeps_an_incomplete_layer_as_it_is():
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.0.mlp.experts.{e}.{n}.weight": torch.randn(4, 3, generator=g)
             for e in range(2) for n in ("gate_proj", "up_proj")}
    state |= {f"model.layers.0.mlp.experts.{e}.down_proj.weight": torch.randn(3, 4, generator=g) for e in range(2)}
    state["model.layers.0.mlp.gate.weight"] = torch.randn(2, 3, generator=g)
    out = expert_names.fuse_checkpoint(state)
    assert set(out) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                        "model.layers.0.mlp.gate.weight"}
    assert torch.equal(out["model.layers.0.mlp.experts.gate_up_proj"][1, 4:], state["model.layers.0.mlp.experts.1.up_proj.weight"])
    del state["model.layers.0.mlp.experts.1.down_proj.weight"]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in expert_names.fuse_checkpoint(state)


def _kernels_run(dtype) -> bool:
    """Whether the C block has kernels for `dtype` here: bf16's on AMX, AVX512-BF16, or (dot products on
    FMAs) wherever the fp32 kernel runs, as fp32's."""
    if dtype == torch.bfloat16:
        return amx_linears.available() or bf16_rows.avx512_bf16() or f32_linears.available()
    return f32_linears.available()


def _stage_bound(x, ids, weights, gate_up, down, u: float) -> torch.Tensor:
    """How far a path that rounds each stage of the experts (gate and up, silu, silu * up, down, the
    weighted pick, the sum over picks) to a relative u, and sums each GEMM in fp32, can be from the exact
    output [T, H]: each stage's error carried forward from the exact values of its inputs (|silu'| <=
    1.1), so the bound scales with what the token's own experts compute, not with the magnitudes of the
    whole chain (which let a wrong expert's output pass). The silu in fp32 to a few ulps (C's e^x), then
    rounded to u."""
    f32 = 2.0**-24
    (t, h), k, i = x.shape, ids.shape[1], down.shape[2]
    out = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        picks = []
        for s in range(k):
            gu, dn, xx = gate_up[ids[tok, s]].double(), down[ids[tok, s]].double(), x[tok].double()
            w = weights[tok, s].double()
            v = gu @ xx
            e_v = u * v.abs() + h * f32 * (gu.abs() @ xx.abs())
            g, up, e_g, e_up = v[:i], v[i:], e_v[:i], e_v[i:]
            silu = torch.nn.functional.silu(g)
            e_s = 1.1 * e_g + (u + 8 * f32) * (silu.abs() + 1.1 * e_g)  # C's e^x and divide: a few fp32 ulps
            a = silu * up
            e_a = e_s * up.abs() + silu.abs() * e_up + e_s * e_up
            e_a = e_a + u * (a.abs() + e_a)
            d = dn @ a
            e_d = dn.abs() @ e_a + i * f32 * (dn.abs() @ (a.abs() + e_a))
            e_d = e_d + u * (d.abs() + e_d)
            e_p = w.abs() * e_d + u * w.abs() * (d.abs() + e_d)  # the weight's own rounding, then the product's
            picks.append((w * d, e_p + u * (w.abs() * (d.abs() + e_d) + e_p)))
        total = sum(p for p, _ in picks)
        e_total = sum(e for _, e in picks) + (k + 1) * f32 * sum(p.abs() + e for p, e in picks)
        out[tok] = e_total + u * (total.abs() + e_total)
    return out


@pytest.mark.parametrize("on_panels", [False, True])
@pytest.mark.parametrize("scores_fp32", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_block_is_the_torch_path_within_its_roundings(dtype, scores_fp32, on_panels):
    """engine/kernels/native/moe_experts.c against `route` + `run`: the same experts wherever the k-th and
    (k+1)-th probabilities are apart by more than both softmaxes' error (a few fp32 ulps; bf16
    logits tie often, and a tie is broken either way); on those tokens both outputs within
    `_stage_bound` of the exact one, each stage's rounding carried through from its exact values. On the
    weights in place, and on their copies as panels (AVX2's way: f32_linear.c's panel groups)."""
    if not _kernels_run(dtype) or (on_panels and not f32_linears.available()):
        pytest.skip("the C block's kernels do not run on this CPU")
    g = torch.Generator().manual_seed(2)
    e, h, i, k = 16, 64, 96, 4
    gate_up, down = (torch.randn(e, 2 * i, h, generator=g) * 0.1).to(dtype), (torch.randn(e, h, i, generator=g) * 0.1).to(dtype)
    panels = tuple(moe_experts._pack_experts(w).packed for w in (gate_up, down)) if on_panels else None
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23  # a stage's rounding, with room (bf16's unit is 2^-9)
    for t in (1, 7, 40):
        x, logits = torch.randn(t, h, generator=g).to(dtype), torch.randn(t, e, generator=g).to(dtype)
        with torch.inference_mode():
            got, ids = moe_experts.block_native(x, logits, k, True, scores_fp32, gate_up, down, on_panels=panels)
            weights, want_ids = moe_experts.route(logits, k, True, scores_fp32)
            want = moe_experts.run(x, want_ids, weights, gate_up, down, torch.nn.functional.silu)
            probs = torch.softmax(logits, -1, dtype=torch.float).sort(-1, descending=True).values
        decided = probs[:, k - 1] - probs[:, k] > 16 * 2.0**-24 * probs[:, k - 1]
        assert decided.float().mean() > 0.5  # the comparison is not vacuous
        assert torch.equal(ids[decided].sort(-1).values, want_ids[decided].sort(-1).values)  # ties inside: any order
        bound = 2 * _stage_bound(x, want_ids, weights, gate_up, down, u)  # each path within one bound of the exact
        err = (got.double() - want.double()).abs()[decided]
        assert (err <= bound[decided] + 1e-30).all(), t
        wrong = moe_experts.run(x, (want_ids + 1) % e, weights, gate_up, down, torch.nn.functional.silu)
        assert ((wrong.double() - want.double()).abs()[decided] > bound[decided]).any()  # the bound tells experts apart


def test_a_fused_push_is_checked_and_handed_over_as_the_checkpoints_blocks():
    """weight_sync/vllm/fused_experts.py: a Mixtral checkpoint's names seen as a transformers 5 model
    names them, and its fused tensors back as the checkpoint's per-expert views."""
    from weight_sync.common.manifest import ParamInfo
    from weight_sync.vllm.fused_experts import FusedView

    infos = {f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": ParamInfo("float32", shape)
             for e in range(2) for w, shape in (("w1", (4, 3)), ("w3", (4, 3)), ("w2", (3, 4)))}
    infos["model.layers.0.block_sparse_moe.gate.weight"] = ParamInfo("float32", (2, 3))
    view = FusedView(infos)
    assert view.infos == {"model.layers.0.mlp.experts.gate_up_proj": ParamInfo("float32", (2, 8, 3)),
                          "model.layers.0.mlp.experts.down_proj": ParamInfo("float32", (2, 3, 4)),
                          "model.layers.0.mlp.gate.weight": ParamInfo("float32", (2, 3))}
    assert view.covers(view.infos) and not view.covers(infos)
    gate_up = torch.arange(48.0).view(2, 8, 3)
    out = dict(view.to_checkpoint([("model.layers.0.mlp.experts.gate_up_proj", gate_up),
                                   ("model.layers.0.mlp.gate.weight", torch.zeros(2, 3))]))
    assert torch.equal(out["model.layers.0.block_sparse_moe.experts.1.w3.weight"], gate_up[1, 4:])
    assert out["model.layers.0.block_sparse_moe.experts.0.w1.weight"].data_ptr() == gate_up.data_ptr()  # a view
    assert "model.layers.0.block_sparse_moe.gate.weight" in out


GROUPS_ACROSS_CALLS = """
import ctypes, torch
from engine.kernels import amx_linears, native_kernels
assert amx_linears.available()  # asks the kernel for the AMX tiles (arch_prctl) first
P, I = ctypes.c_void_p, ctypes.c_int64
fn = native_kernels.function("amx_linear", "amx_linear_bf16_groups", (P, I, P, P, I, P, I, P), ctypes.c_int)
torch.manual_seed(0)
# (groups, n): one group of many tiles, then more groups of fewer tiles in all, then many of many
for groups, n in ((1, 512), (8, 32), (16, 512)):
    k, rows = 64, 3
    w = torch.randn(groups, n, k).bfloat16()
    x = torch.randn(groups * rows, k).bfloat16()
    starts = torch.arange(0, groups * rows + 1, rows, dtype=torch.int64)
    experts = torch.arange(groups, dtype=torch.int64)
    out = torch.empty(groups * rows, n, dtype=torch.bfloat16)
    assert fn(x.data_ptr(), k, starts.data_ptr(), experts.data_ptr(), groups, w.data_ptr(), n, out.data_ptr()) == 0
    want = torch.cat([x[g * rows:(g + 1) * rows].float() @ w[g].float().T for g in range(groups)])
    assert (out.float() - want).abs().max() <= 0.02 * want.abs().max(), (groups, n)
print("ok")
"""


def test_the_grouped_kernel_keeps_its_buffers_in_bounds_across_calls_of_other_shapes():
    """amx_linear_bf16_groups keeps its tile and offset lists between calls: a call with more groups
    of fewer tiles in all once wrote past the offsets (heap corruption that aborted a later call).
    Run under glibc's checking allocator, which aborts on such a write."""
    import os
    import subprocess
    import sys

    if not amx_linears.available():
        pytest.skip("no AMX tiles on this CPU")
    debug = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
    env = dict(os.environ, MALLOC_CHECK_="3", **({"LD_PRELOAD": debug} if os.path.exists(debug) else {}))
    run = subprocess.run([sys.executable, "-c", GROUPS_ACROSS_CALLS], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def test_each_group_has_the_rows_kernels_bits_whatever_its_size():
    """Groups of 1 to 140 rows (33-128 go over K in steps, their sums carried between steps) in one
    call: each group's rows are bit for bit the rows kernel's on its expert's weight alone."""
    import ctypes

    from engine.kernels import native_kernels

    if not amx_linears.available():
        pytest.skip("no AMX tiles on this CPU")
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn = native_kernels.function("amx_linear", "amx_linear_bf16_groups", (P, I, P, P, I, P, I, P), ctypes.c_int)
    g = torch.Generator().manual_seed(0)
    sizes, n, k = [1, 40, 140, 17, 100, 64], 48, 800  # K: 25 chunks, a 1-chunk last step
    w = torch.randn(len(sizes), n, k, generator=g).bfloat16()
    x = torch.randn(sum(sizes), k, generator=g).bfloat16()
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64)
    experts = torch.tensor([3, 0, 5, 1, 2, 4], dtype=torch.int64)  # not in order
    out = torch.empty(sum(sizes), n, dtype=torch.bfloat16)
    assert fn(x.data_ptr(), k, starts.data_ptr(), experts.data_ptr(), len(sizes), w.data_ptr(), n,
              out.data_ptr()) == 0
    for i, e in enumerate(experts.tolist()):
        rows = slice(starts[i].item(), starts[i + 1].item())
        assert torch.equal(out[rows], amx_linears.linear_bf16_rows(x[rows], amx_linears.rows_of(w[e]))), i


@pytest.mark.parametrize("n,k", [(48, 800), (36, 2048)])  # 8 weight rows a block; 4 (n % 8), rows copied apart
def test_each_group_has_the_avx512_kernels_bits_whatever_its_size(n, k):
    """bf16_rows_groups (bf16 experts without AMX): groups of 0 to 140 rows in one call, in both block
    shapes (1-12 rows, 13 and more) and K chunked (up to 8 rows) or whole: each group's rows are bit for
    bit bf16_rows_linear's on its expert's weight alone."""
    import ctypes

    from engine.kernels import derived_weights, native_kernels

    if not bf16_rows.avx512_bf16():
        pytest.skip("no AVX512-BF16 on this CPU")
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn = native_kernels.function("bf16_rows", "bf16_rows_groups", (P, I, P, P, I, P, I, P), ctypes.c_int)
    g = torch.Generator().manual_seed(n + k)
    sizes = [1, 40, 0, 140, 8, 17, 100, 5]
    w = torch.randn(len(sizes), n, k, generator=g).bfloat16()
    x = torch.randn(sum(sizes), k, generator=g).bfloat16()
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64)
    experts = torch.tensor([3, 0, 6, 5, 7, 1, 2, 4], dtype=torch.int64)  # not in order
    out = torch.full((sum(sizes), n), float("nan"), dtype=torch.bfloat16)
    assert fn(x.data_ptr(), k, starts.data_ptr(), experts.data_ptr(), len(sizes), w.data_ptr(), n,
              out.data_ptr()) == 0
    for i, e in enumerate(experts.tolist()):
        rows = slice(starts[i].item(), starts[i + 1].item())
        want = bf16_rows.avx512_linear_rows(x[rows], derived_weights.rows_of(w[e]))
        assert torch.equal(out[rows], want), i
    assert fn(x.data_ptr(), 40, starts.data_ptr(), experts.data_ptr(), len(sizes), w.data_ptr(), n,
              out.data_ptr()) == -2  # K not in thirty-twos: refused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_router_is_f_linear_within_its_roundings(dtype):
    """router_logits (both of the engine's forwards route through it): each logit a fp32 sum over H
    in another order than F.linear's, rounded once to the dtype: apart by at most H roundings of
    the sum of the products' magnitudes, plus one rounding of each result in bf16 (both round)."""
    if not _kernels_run(dtype):
        pytest.skip("the C block's kernels do not run on this CPU")
    g = torch.Generator().manual_seed(3)
    for t, h, e in ((1, 64, 8), (37, 1024, 32), (5, 72, 128)):
        x, w = torch.randn(t, h, generator=g).to(dtype), torch.randn(e, h, generator=g).to(dtype)
        with torch.inference_mode():
            got = moe_experts.router_logits(x, w)
            want = torch.nn.functional.linear(x, w)
        mag = x.abs().double() @ w.abs().double().T
        ulp = 2.0**-8 if dtype == torch.bfloat16 else 0.0
        bound = h * 2.0**-24 * mag + ulp * want.abs().double()
        assert got is not None and got.dtype == dtype and got.shape == (t, e)
        assert ((got.double() - want.double()).abs() <= bound).all(), (t, h, e)


@pytest.mark.parametrize("n,k", [(48, 800), (37, 70)])  # whole 16s of K and a tail; n not in fours
def test_bf16_dot_groups_give_each_row_its_own_bits_whatever_shares_its_expert(n, k):
    """bf16_dot_groups (bf16 experts on AVX2): groups of 0 to 140 rows in one call, experts out of
    order; each row's outputs are bit for bit that row's alone through its expert (the sums do not
    depend on the rows beside it: a batch-invariant engine), and within an fp32 dot product's rounding
    plus one bf16 rounding of the exact product."""
    import ctypes

    from engine.kernels import native_kernels

    if not f32_linears.available():
        pytest.skip("no AVX-512 or AVX2, or no C compiler")
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn = native_kernels.function("moe_experts", "bf16_dot_groups", (P, I, P, P, I, P, I, P), ctypes.c_int)
    g = torch.Generator().manual_seed(n + k)
    sizes = [1, 40, 0, 140, 8, 17, 5]
    w = torch.randn(len(sizes), n, k, generator=g).bfloat16()
    x = torch.randn(sum(sizes), k, generator=g).bfloat16()
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64)
    experts = torch.tensor([3, 0, 6, 5, 1, 2, 4], dtype=torch.int64)  # not in order

    def call(x, starts, experts):
        out = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16)
        assert fn(x.data_ptr(), k, starts.data_ptr(), experts.data_ptr(), len(experts), w.data_ptr(), n,
                  out.data_ptr()) == 0
        return out

    out = call(x, starts, experts)
    one = torch.tensor([0, 1], dtype=torch.int64)
    for i, e in enumerate(experts.tolist()):
        for r in range(starts[i].item(), starts[i + 1].item(), 7):  # every 7th row, alone through its expert
            assert torch.equal(out[r], call(x[r:r + 1].contiguous(), one, torch.tensor([e]))[0]), (i, r)
        rows = slice(starts[i].item(), starts[i + 1].item())
        exact = x[rows].double() @ w[e].double().T
        # fp32 sums of k exact products (k roundings at most): k u32 sum|terms|; then bf16's half ulp
        err = (out[rows].double() - exact).abs()
        bound = k * 2.0**-24 * (x[rows].double().abs() @ w[e].double().abs().T) + 2.0**-8 * exact.abs()
        assert (err <= bound * 1.0001 + 1e-30).all(), i
    wrong = call(x, starts, experts.roll(1))  # another expert's weights fall outside the bound
    assert not torch.equal(wrong[1:41], out[1:41])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 800), (32, 1024), (96, 70)])  # two chunks of K; rows a page long; a tail
def test_panel_groups_give_each_row_the_dense_kernels_bits_whatever_shares_its_expert(n, k, dtype):
    """f32_linear.c's f32_panel_groups* (experts over a copy of their weights as panels: AVX2's way): groups
    of 0 to 140 rows in one call, experts out of order; each row's outputs are bit for bit what the dense
    panels kernel gives that row alone on its expert's weight (so the sums do not depend on the rows
    beside it: a batch-invariant engine), and within an fp32 dot product's rounding (plus one bf16
    rounding) of the exact product."""
    import ctypes

    from engine.kernels import native_kernels

    if not f32_linears.available():
        pytest.skip("no AVX-512 or AVX2, or no C compiler")
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn = native_kernels.function("f32_linear", moe_experts._PANEL_GROUPS[dtype], (P, I, P, P, I, P, I, P), ctypes.c_int)
    g = torch.Generator().manual_seed(n + k)
    sizes = [1, 40, 0, 140, 8, 17, 5]
    w = torch.randn(len(sizes), n, k, generator=g).to(dtype)
    x = torch.randn(sum(sizes), k, generator=g).to(dtype)
    packed = moe_experts._pack_experts(w).packed
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64)
    experts = torch.tensor([3, 0, 6, 5, 1, 2, 4], dtype=torch.int64)  # not in order

    def call(x, starts, experts, weights=packed):
        out = torch.full((x.shape[0], n), float("nan"), dtype=dtype)
        assert fn(x.data_ptr(), k, starts.data_ptr(), experts.data_ptr(), len(experts), weights.data_ptr(), n,
                  out.data_ptr()) == 0
        return out

    out = call(x, starts, experts)
    for i, e in enumerate(experts.tolist()):
        rows = slice(starts[i].item(), starts[i + 1].item())
        for r in range(rows.start, rows.stop, 7):  # every 7th row, alone through the dense kernel
            alone = f32_linears.linear(x[r:r + 1].float(), f32_linears.pack(w[e]))[0].to(dtype)
            assert torch.equal(out[r], alone), (i, r)
        exact = x[rows].double() @ w[e].double().T
        # fp32 sums of k exact products (k roundings at most): k u32 sum|terms|; then bf16's half ulp
        err = (out[rows].double() - exact).abs()
        half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 0.0
        bound = k * 2.0**-24 * (x[rows].double().abs() @ w[e].double().abs().T) + half_ulp * exact.abs()
        assert (err <= bound * 1.0001 + 1e-30).all(), i
    wrong = call(x, starts, experts.roll(1))  # another expert's weights fall outside the bound
    assert not torch.equal(wrong[1:41], out[1:41])


def test_the_experts_panels_are_taken_where_asked(moe_dir, monkeypatch):
    """attach_panels: ROLLOUT_EXPERT_PANELS=1 serves every sparse block's experts from panels (derived
    again after a write to a weight), 0 from their weights in place; ROLLOUT_F32_IN_PLACE=1 (a sidecar short
    of memory) keeps them in place."""
    from engine.models import moe_model

    if not f32_linears.available():
        pytest.skip("no AVX-512 or AVX2, or no C compiler")
    for switch, in_place, want in (("1", "0", True), ("0", "0", False), ("1", "1", False)):
        monkeypatch.setenv(moe_experts.PANELS_SWITCH, switch)
        monkeypatch.setenv(f32_linears.IN_PLACE_SWITCH, in_place)
        model = moe_model.load(moe_dir, torch.float32)
        blocks = moe_model.sparse_blocks(model)
        assert moe_experts.attach_panels(blocks) == (len(blocks) if want else 0)
        served = moe_experts.served_panels(blocks[0].experts)
        assert (served is not None) == want
        if want:
            e = blocks[0].experts
            want_gate_up = f32_linears.pack(e.gate_up_proj.detach().reshape(-1, e.gate_up_proj.shape[-1])).packed
            assert torch.equal(served[0], want_gate_up)
            with torch.no_grad():
                e.gate_up_proj.mul_(2)  # a write in place: the copy is derived again
            assert torch.equal(moe_experts.served_panels(e)[0], want_gate_up * 2)

