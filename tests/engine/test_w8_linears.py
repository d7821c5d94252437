"""engine/kernels/w8_linears.py: weight-only int8 without AMX tiles (AVX512-BF16's dot products, or AVX2's
FMAs on the chunks widened into fp32 panels) multiplies the bf16 weights the AMX kernel widens (q times its
scale, rounded once) within a bf16 GEMM's error bound, each
output's bits its own row's and column's alone (a row alone, in a batch, in another block of rows), at
any shape the packed copy takes (columns and K past whole chunks)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import amx_linears, int8_linears, w8_linears

w8_kernel = pytest.mark.skipif(not w8_linears.available(), reason="neither AVX512-BF16 nor AVX2 with FMA here")
# one row; a block of a few; columns and K past whole chunks of 32; two and three blocks of 12 rows; a prefill's
SHAPES = [(1, 192, 576), (7, 50, 100), (13, 96, 70), (32, 960, 576), (33, 576, 1536), (300, 64, 1536)]


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, the bf16 weights the kernels widen q to)."""
    g = torch.Generator().manual_seed(seed)
    q, scale = int8_linears.quantize_groups(torch.randn(n, k, generator=g))
    return q, scale, amx_linears.widened_w8(q, scale)


@w8_kernel
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_it_multiplies_the_bf16_weights_q_times_scale(m, n, k, out_dtype):
    q, scale, w = _weights(n, k, m + n * k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    got = w8_linears.linear_w8(x, amx_linears.pack_w8(q, scale), out_dtype).double()
    exact = x.double() @ w.double().t()
    # every bf16 x bf16 product exact in fp32; k fp32 roundings of the running sum at most, then the output's own
    magnitude = x.double().abs() @ w.double().abs().t()
    last = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-23
    assert ((got - exact).abs() <= k * 2.0**-24 * magnitude + last * exact.abs() + 1e-30).all()


@w8_kernel
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_are_its_own_whatever_the_batch(out_dtype):
    """Alone, first, last, or in the second or third block of rows (the later blocks read the widened
    weights back from the thread's panel): the same bits, so a row prefilled and decoded agree."""
    q, scale, _ = _weights(100, 1536, 1)
    packed = amx_linears.pack_w8(q, scale)
    x = torch.randn(30, 1536, generator=torch.Generator().manual_seed(2)).bfloat16()
    batch = w8_linears.linear_w8(x, packed, out_dtype)
    for row in (0, 13, 29):
        assert torch.equal(w8_linears.linear_w8(x[row:row + 1], packed, out_dtype)[0], batch[row])
    assert torch.equal(w8_linears.linear_w8(x.flip(0), packed, out_dtype), batch.flip(0))


def test_the_c_loop_takes_the_amx_kernel_where_it_runs_else_this_one():
    bf16, f32 = w8_linears.c_kernels()
    want = "amx_linear" if amx_linears.available() else "w8_linear"
    assert bf16[0] == want == f32[0] and bf16[1].endswith("_bf16") and f32[1].endswith("_f32")


@w8_kernel
def test_the_int8_engine_picks_it_where_there_are_no_amx_tiles():
    want = "amx_w8" if amx_linears.available() else "w8"
    assert int8_linears.kernel() == (want, 127)
