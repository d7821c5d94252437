"""engine/kernels/amx_linears.py: the tile layouts (pure, run anywhere) and, where the CPU has AMX, the
kernels: int8 bit for bit against the exact integer product scaled as the oneDNN path scales it,
bf16 and weight-only int8 within a bf16 GEMM's error bound, bf16 on the weights in place with the
packed kernel's bits, and the int8 engine's logits unchanged by the kernel swap."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import amx_linears, int8_linears, native_kernels, native_quantize

amx = pytest.mark.skipif(not amx_linears.available(), reason="no AMX tiles on this CPU")
SHAPES = [(1, 192, 576), (7, 50, 100), (32, 960, 576), (33, 576, 1536), (256, 96, 64), (300, 64, 1536)]


def _unpack(w: amx_linears.AmxWeight) -> torch.Tensor:
    """The inverse of pack's permutation: the zero-padded [n, k] again."""
    pn, kc, _, rows, _, e = w.packed.shape
    return w.packed.permute(0, 2, 4, 1, 3, 5).reshape(pn * 32, kc * rows * e)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_pack_is_a_tile_layout_of_the_weight(dtype):
    w = (torch.randn(50, 100) * 40).to(dtype)
    packed = amx_linears.pack(w)
    e = 4 // w.element_size()  # K values per 4-byte pair
    tk = 64 if dtype == torch.int8 else 32  # K values per 64-byte tile row
    assert packed.packed.shape == (2, -(-100 // tk), 2, 16, 16, e)
    whole = _unpack(packed)
    assert torch.equal(whole[:50, :100], w)
    assert whole[50:].abs().sum() == 0 and whole[:, 100:].abs().sum() == 0  # the padding is zeros
    # the first B tile's row r, column j holds w[j, e*r .. e*r + e): the pairs TDPB* multiplies
    assert torch.equal(packed.packed[0, 0, 0, 3, 5], w[5, 3 * e:4 * e])


def test_pack_w8_is_each_chunks_scales_then_its_tiles():
    q = torch.randint(-127, 128, (50, 100), dtype=torch.int8)
    _, scale = int8_linears.quantize_groups(torch.randn(50, 100))
    packed = amx_linears.pack_w8(q, scale).packed
    groups = 32 // amx_linears.W8_GROUP  # a chunk's groups of K
    assert packed.shape == (2, 4, 64 * groups + 1024)  # 32 columns x 32 values of K a chunk, K padded to 128
    tiles = packed[..., 64 * groups:].reshape(2, 4, 2, 16, 16, 2)
    whole = tiles.permute(0, 2, 4, 1, 3, 5).reshape(64, 128)
    assert torch.equal(whole[:50, :100], q) and whole[50:].abs().sum() == 0 and whole[:, 100:].abs().sum() == 0
    # [column block][chunk][group][32 columns]
    scales = packed[..., :64 * groups].contiguous().view(torch.bfloat16).view(2, 4, groups, 32)
    g = 2 * groups + 1  # group 1 of chunk 2 (its K from 64 + W8_GROUP)
    assert torch.equal(scales[0, 2, 1], scale[:32, g]) and torch.equal(scales[1, 2, 1, :18], scale[32:, g])
    assert torch.equal(scales[1, 3, 0, :18], scale[32:, 3 * groups])  # the last group: K 96-99
    assert scales[:, 3, 1:].abs().sum() == 0 and scales[1, :, :, 18:].abs().sum() == 0  # past K and N: zero


def test_quantize_groups_keeps_each_group_within_its_scale():
    w = torch.randn(40, 70) * torch.logspace(-3, 1, 70)  # groups of very different sizes
    q, scale = int8_linears.quantize_groups(w)
    group = amx_linears.W8_GROUP
    assert q.shape == (40, 70) and scale.shape == (40, -(-70 // group)) and q.abs().max() <= 127
    s = scale.float().repeat_interleave(group, dim=1)[:, :70]
    # round to the nearest step, but where the bf16 scale rounded down and |w| / s passed 127 (clamped)
    assert ((q.float() * s - w).abs() <= s * (0.5 + 127 * 2.0**-8)).all()


@amx
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_weight_only_kernel_multiplies_the_bf16_weights_q_times_scale(m, n, k, out_dtype):
    g = torch.Generator().manual_seed(m + n * k)
    x = torch.randn(m, k, generator=g).bfloat16()
    q, scale = int8_linears.quantize_groups(torch.randn(n, k, generator=g))
    w = amx_linears.widened_w8(q, scale)  # what the kernel widens to
    got = amx_linears.linear_w8(x, amx_linears.pack_w8(q, scale), out_dtype).double()
    exact = x.double() @ w.double().t()
    # as test_bf16_kernel's: k fp32 roundings of the exact products' sum, then the output's own
    magnitude = x.double().abs() @ w.double().abs().t()
    last = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-23
    assert ((got - exact).abs() <= k * 2.0**-24 * magnitude + last * exact.abs() + 1e-30).all()


@amx
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_is_the_exact_product_scaled_as_onednn_scales_it(m, n, k, out_dtype):
    g = torch.Generator().manual_seed(m * n + k)
    q = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[0, : k // 2], w[0, : k // 2] = 127, -127  # full-scale pairs: what a 16-bit sum would saturate on
    col, row = torch.rand(n, generator=g) / 50, torch.rand(m, generator=g) / 50
    exact = (q.double() @ w.double().t()).float()  # |sum| < 2^24: exact in fp32
    want = ((exact * col).to(out_dtype).float() * row[:, None]).to(out_dtype)
    got = amx_linears.linear_s8(q, row, amx_linears.pack(w), col, out_dtype)
    assert torch.equal(got, want)


@amx
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_kernel_within_a_bf16_gemms_error(m, n, k, with_bias):
    g = torch.Generator().manual_seed(k + m)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    got = amx_linears.linear_bf16(x, amx_linears.pack(w), bias).double()
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    # fp32 sums of exact bf16 products: k roundings of 2^-24 of sum |x||w| at most, then one rounding to
    # bf16 (2^-9 of the value, 8 bits of mantissa)
    magnitude = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    bound = k * 2.0**-24 * magnitude + 2.0**-8 * exact.abs() + 1e-30
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).abs().max() > 0 or m * n < 100  # it did round: the bound is what holds it


@amx
@pytest.mark.parametrize("m,n,k", [(1, 192, 576), (7, 64, 128), (33, 576, 1536), (300, 48, 64), (17, 16, 32),
                                   (100, 80, 1056),  # 4 row tiles (the last of 4 rows) in steps of K, a 1-chunk last
                                   (600, 48, 4128),  # 3 row blocks, K in 3 blocks (sums carried in fp32)
                                   # rows read R at a time (rows of whole 4 KB pages; up to 32 rows of x):
                                   (32, 192, 1024), (1, 256, 1024),  # R 2: 3 groups (two threads), 1 row
                                   (20, 384, 512), (32, 128, 1536)])  # R 4: 20 rows (a half tile), k 1536
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_on_the_weights_in_place_gives_the_packed_kernels_bits(m, n, k, with_bias):
    g = torch.Generator().manual_seed(n + k + m)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    want = amx_linears.linear_bf16(x, amx_linears.pack(w), bias)
    assert torch.equal(amx_linears.linear_bf16_rows(x, amx_linears.rows_of(w), bias), want)


@amx
@pytest.mark.parametrize("m,n,k", [(1, 192, 576), (33, 576, 1536), (300, 48, 64), (600, 48, 4128), (20, 384, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_out_is_the_bf16_outs_sums_before_their_rounding(m, n, k, with_bias):
    """out_dtype fp32 (the fp32 LM head): the very sums the bf16 output rounds (rounded here, the
    bf16 output's bits), and an fp32 GEMM of the upcast operands within fp32's bound of a reordered sum."""
    g = torch.Generator().manual_seed(n + k + m + 1)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    rows = amx_linears.rows_of(w)
    out = amx_linears.linear_bf16_rows(x, rows, bias, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out.bfloat16(), amx_linears.linear_bf16_rows(x, rows, bias))
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    bound = 2 * k * 2.0**-24 * (x.double().abs() @ w.double().abs().t()) + 2.0**-24 * exact.abs() + 1e-30
    assert ((out.double() - exact).abs() <= bound).all()
    assert not torch.equal(out, out.bfloat16().float())  # not rounded to bf16 on the way out


@amx
def test_a_groups_segments_are_read_where_each_weight_lies():
    """q/k/v as three tensors of their own: the product with the rows stacked, without stacking them."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 128, generator=g).bfloat16() for n in (64, 32, 16))
    x = torch.randn(40, 128, generator=g).bfloat16()
    rows = amx_linears.rows_of([q, k, v])
    assert rows.nbytes == 0 and [t.data_ptr() for t in rows.weights] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    want = amx_linears.linear_bf16(x, amx_linears.pack(torch.cat([q, k, v])))
    assert torch.equal(amx_linears.linear_bf16_rows(x, rows), want)
    with torch.no_grad():
        k.mul_(2)  # written in place: read as it is now, no copy to make again
    assert torch.equal(amx_linears.linear_bf16_rows(x, rows),
                       amx_linears.linear_bf16(x, amx_linears.pack(torch.cat([q, k, v]))))


@amx
@pytest.mark.parametrize("sizes", [(256, 128, 128), (128, 64, 64)])  # 4 rows read as one; a segment too short: 1
def test_segments_read_four_rows_at_a_time_give_the_stacked_products_bits(sizes):
    g = torch.Generator().manual_seed(sum(sizes))
    q, k, v = (torch.randn(n, 512, generator=g).bfloat16() for n in sizes)
    x = torch.randn(32, 512, generator=g).bfloat16()
    bias = torch.randn(sum(sizes), generator=g).bfloat16()
    want = amx_linears.linear_bf16(x, amx_linears.pack(torch.cat([q, k, v])), bias)
    assert torch.equal(amx_linears.linear_bf16_rows(x, amx_linears.rows_of([q, k, v]), bias), want)


def test_rows_fit_takes_bf16_rows_in_sixteens_and_k_in_thirty_twos():
    bf = torch.bfloat16
    assert amx_linears.rows_fit([torch.zeros(48, 64, dtype=bf)])
    assert amx_linears.rows_fit([torch.zeros(16, 32, dtype=bf)] * 3)
    assert not amx_linears.rows_fit([torch.zeros(16, 32, dtype=bf)] * 4)
    assert not amx_linears.rows_fit([torch.zeros(40, 64, dtype=bf)])  # rows % 16
    assert not amx_linears.rows_fit([torch.zeros(48, 48, dtype=bf)])  # k % 32
    assert not amx_linears.rows_fit([torch.zeros(48, 64)])  # fp32
    assert not amx_linears.rows_fit([torch.zeros(48, 64, dtype=bf), torch.zeros(16, 96, dtype=bf)])
    assert not amx_linears.rows_fit([torch.zeros(64, 48, dtype=bf).t()])  # rows not contiguous


@amx
def test_int8_engine_linears_give_the_onednn_paths_bits(monkeypatch):
    """A model's int8 linears give the same outputs on the AMX kernel as on oneDNN's op (ROLLOUT_AMX=0)."""
    lin = torch.nn.Linear(576, 960, bias=False).bfloat16()
    x = torch.randn(32, 576).bfloat16()
    outs = {}
    for how in (("amx", 127), ("onednn", 127)):
        copy = int8_linears.derive(lin.weight, how)
        outs[how[0]] = int8_linears._int8_apply(lin, x, copy, None)
    assert torch.equal(outs["amx"], outs["onednn"])


def test_switch_off_leaves_onednn(monkeypatch):
    monkeypatch.setenv(amx_linears.ENV_SWITCH, "0")
    amx_linears.available.cache_clear()
    try:
        assert not amx_linears.available()
        with pytest.raises(RuntimeError, match="AMX"):
            int8_linears.derive(torch.randn(32, 64), ("amx", 127))
    finally:
        monkeypatch.delenv(amx_linears.ENV_SWITCH)
        amx_linears.available.cache_clear()
        native_kernels.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(50, 100), (64, 64), (33, 576), (7, 31)])
def test_the_one_pass_copy_has_the_torch_ways_bits(dtype, n, k):
    """engine/kernels/native/quantize_groups.c against quantize_groups then pack_w8 (runs on any CPU)."""
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * torch.logspace(-3, 1, k)).to(dtype)
    w[0, :32] = 0  # an all-zero group's scale: bf16's smallest normal
    w[1, 0] = 1e4  # an outlier that takes its group's scale
    native = native_quantize.quantize_groups_packed(w)
    if native is None:
        pytest.skip("no C compiler for the native kernels")
    q, scale = int8_linears.quantize_groups(w)
    assert torch.equal(native[1], scale)
    assert torch.equal(native[0].view(-1), amx_linears.pack_w8(q, scale).packed.view(torch.uint8).view(-1))
