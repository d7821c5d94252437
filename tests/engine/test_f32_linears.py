"""engine/kernels/f32_linears.py: the panel layout (pure, runs anywhere) and, where the CPU has AVX-512 or AVX2,
the kernel within a plain fp32 GEMM's error bound, with and without a bias, at any row count; a bf16 weight's
bf16 panels give its fp32 panels' bits."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import derived_weights, f32_linears, packed_linears

f32_kernel = pytest.mark.skipif(not f32_linears.available(),
                                reason="the fp32 kernel serves only on AVX-512 or AVX2 CPUs")


def test_pack_is_panels_of_32_columns():
    w = torch.randn(50, 100)
    p = f32_linears.pack(w)
    assert p.packed.shape == (2, 100, 32) and (p.n, p.k) == (50, 100)
    assert torch.equal(p.packed[0, 7, 5], w[5, 7]) and torch.equal(p.packed[1, 3, 17], w[49, 3])
    assert p.packed[1, :, 18:].abs().sum() == 0  # the padding columns are zeros


@f32_kernel
@pytest.mark.parametrize("m,n,k", [(1, 192, 576), (7, 50, 100), (32, 960, 576), (33, 576, 1536), (256, 96, 64),
                                   (300, 70, 1536), (9, 31, 7), (13, 40, 257), (14, 33, 769),  # K chunks of 768: an edge
                                   (13, 40, 1024), (33, 64, 2048)])  # rows 4 KB apart: copied apart first
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_within_an_fp32_gemms_error(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    got = f32_linears.linear(x, f32_linears.pack(w), bias).double()
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    # k sequential FMAs, each rounding once (relative 2^-24), then the bias: |error| <= (k + 1) u sum|terms|
    magnitude = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    assert ((got - exact).abs() <= (k + 1) * 2.0**-24 * magnitude + 1e-30).all()
    assert (got - exact).abs().max() > 0  # it did round: the bound is what holds it


@pytest.mark.parametrize("n,k", [(1536, 576), (50, 100), (33, 7), (32, 1), (1, 64)])
def test_the_one_pass_pack_is_torchs_pack(n, k):
    """engine/kernels/native/f32_pack.c's f32_pack_rows against the torch ops it replaces: the same bytes."""
    if f32_linears._pack_fn() is None:
        pytest.skip("no C compiler for the native kernels")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    native, ref = f32_linears.pack(w), f32_linears.pack_torch(w)
    assert (native.n, native.k) == (ref.n, ref.k) and torch.equal(native.packed, ref.packed)


@pytest.mark.parametrize("rows,k", [((576, 192, 192), 576), ((40, 9), 100), ((1, 2, 3), 17), ((64, 64), 16)])
def test_a_group_packed_from_its_members_is_the_stacked_weights_pack(rows, k):
    """Segments packed where they lie (rows that straddle a panel, K not a multiple of 16): the
    bytes of the stacked copy's pack, and into a retired copy's memory just as into fresh memory."""
    if f32_linears._pack_fn() is None:
        pytest.skip("no C compiler for the native kernels")
    g = torch.Generator().manual_seed(sum(rows) + k)
    parts = [torch.randn(r, k, generator=g) for r in rows]
    ref = f32_linears.pack_torch(torch.cat(parts))
    assert torch.equal(f32_linears.pack(parts).packed, ref.packed)
    retired = f32_linears.pack([torch.randn(r, k, generator=g) for r in rows])
    reused = f32_linears.pack(parts, into=retired)
    assert reused.packed.data_ptr() == retired.packed.data_ptr() and torch.equal(reused.packed, ref.packed)
    other = f32_linears.pack(torch.randn(8, k, generator=g))  # another shape's memory is not taken
    assert f32_linears.pack(parts, into=other).packed.data_ptr() != other.packed.data_ptr()


@f32_kernel
@pytest.mark.parametrize("m", [1, 7, 8, 20, 31, 32, 33, 100])
@pytest.mark.parametrize("n,k", [(192, 576), (50, 100), (33, 7), (40, 2000), (40, 2048)])
def test_on_the_weights_in_place_the_packed_kernels_bits(m, n, k):
    """f32_linear_rows, both of its ways (the rows broadcast at 8-32 rows, panels made per call
    otherwise), against the packed kernel: the same sums in the same order, so the same bits."""
    from engine.kernels.derived_weights import rows_of

    g = torch.Generator().manual_seed(m + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for bias in (None, b):
        assert torch.equal(f32_linears.linear_rows(x, rows_of(w), bias), f32_linears.linear(x, f32_linears.pack(w), bias))
    parts = [w[:n // 2].contiguous(), w[n // 2:].contiguous()]  # a group's members, each where it lies
    assert torch.equal(f32_linears.linear_rows(x, rows_of(parts)), f32_linears.linear(x, f32_linears.pack(w)))


@f32_kernel
@pytest.mark.parametrize("m", [1, 7, 8, 20, 31, 32, 33, 100])
@pytest.mark.parametrize("n,k", [(192, 576), (50, 100), (33, 7), (40, 2000), (70, 2048), (36, 769)])
def test_on_bf16_weights_in_place_the_bf16_panels_bits(m, n, k):
    """f32_linear_rows_bf16 (a bf16 model's weights read where they lie: tiles in registers up to 7 rows on
    AVX2, bf16 panels laid out per call above: whole runs of 32 values of K, a tail, rows past n) against the
    bf16 panels packed once: the same bits; a group's members where they lie too."""
    from engine.kernels.derived_weights import rows_of

    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
    b, packed = torch.randn(n, generator=g), f32_linears.pack(w)
    for bias in (None, b):
        assert torch.equal(f32_linears.linear_rows(x, rows_of(w), bias), f32_linears.linear(x, packed, bias))
    parts = [w[:n // 3].contiguous(), w[n // 3:n // 2].contiguous(), w[n // 2:].contiguous()]
    assert torch.equal(f32_linears.linear_rows(x, rows_of(parts)), f32_linears.linear(x, packed))


@f32_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_rows_give_no_rows(dtype):
    """A call of no rows (an empty batch) returns an empty output, fp32 or bf16 panels, and the next call of
    rows is as it was: there are no blocks of rows to share the next chunk's prefetch by."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 1600, generator=g), f32_linears.pack(torch.randn(70, 1600, generator=g).to(dtype))
    assert f32_linears.linear(x[:0], w).shape == (0, 70)
    assert torch.equal(f32_linears.linear(x, w), torch.cat([f32_linears.linear(x[i:i + 1], w) for i in range(5)]))


@f32_kernel
@pytest.mark.parametrize("k", [1024, 2048, 6144])
def test_a_rows_bits_alone_and_among_rows_copied_apart(k):
    """Rows of 4 KB multiples are copied a cache line apart before a call of several (f32_linear.c's
    staggered_rows); one row alone is read where it lies: the same sums, the same bits."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(30, k, generator=g), torch.randn(96, k, generator=g)
    packed = f32_linears.pack(w)
    together = f32_linears.linear(x, packed)
    assert torch.equal(together, torch.cat([f32_linears.linear(x[i : i + 1], packed) for i in range(30)]))
    assert torch.equal(together[5:17], f32_linears.linear(x[5:17], packed))


@f32_kernel
@pytest.mark.parametrize("m,n,k", [(1, 192, 576), (7, 50, 100), (13, 40, 257), (33, 576, 1536), (14, 33, 769),
                                   (300, 70, 1536), (33, 64, 2048)])
def test_bf16_panels_give_the_fp32_panels_bits(m, n, k):
    """A bf16 weight packed as bf16 (half the bytes; each value widened exactly as the kernel loads it)
    against the same weight widened first and packed in fp32: the same values, the same FMAs, the same
    bits; a group's members packed where they lie too, and into a retired copy's memory."""
    g = torch.Generator().manual_seed(m * n + k)
    x, w, bias = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    half = f32_linears.pack(w)
    assert half.packed.dtype == torch.bfloat16 and half.packed.shape == (-(-n // 32), k, 32)
    want = f32_linears.linear(x, f32_linears.pack(w.float()), bias)
    assert torch.equal(f32_linears.linear(x, half, bias), want)
    parts = [w[:n // 3].contiguous(), w[n // 3:].contiguous()]
    assert torch.equal(f32_linears.pack(parts).packed, half.packed)
    retired = f32_linears.pack(torch.randn(n, k, generator=g).bfloat16())
    assert f32_linears.pack(parts, into=retired).packed.data_ptr() == retired.packed.data_ptr()
    assert torch.equal(f32_linears.linear(x, retired, bias), want)
    fp32 = f32_linears.pack(torch.randn(n, k, generator=g))  # an fp32 copy's memory is not taken
    assert f32_linears.pack(w, into=fp32).packed.data_ptr() != fp32.packed.data_ptr()


@pytest.mark.skipif(not f32_linears.available() or packed_linears.compute_dtype(torch.bfloat16) != torch.float32,
                    reason="a bf16 model runs on the fp32 kernel only on a CPU without bf16 kernels (AVX2)")
def test_a_bf16_models_copy_on_avx2_is_bf16_panels():
    """The copy a bf16 linear derives where it is multiplied in fp32: bf16 panels, half the bytes of an
    fp32 copy, and its forward the fp32 copy's bits rounded to bf16."""
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 70).bfloat16().requires_grad_(False)
    x = torch.randn(5, 96, generator=g).bfloat16()
    packed_linears.pack(linear, torch.float32)
    copy = derived_weights.current(linear)
    assert isinstance(copy, f32_linears.F32Weight) and copy.packed.dtype == torch.bfloat16
    assert copy.nbytes == 3 * 96 * 32 * 2
    want = f32_linears.linear(x.float(), f32_linears.pack(linear.weight.float()), linear.bias.float()).bfloat16()
    assert torch.equal(linear(x), want)
