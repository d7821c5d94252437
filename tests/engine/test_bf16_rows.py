"""engine/kernels/native/bf16_rows.c (bf16 linears on AVX512-BF16, the weights read in place): each output
the fp32 sum of its exact products within that sum's rounding bound, the bf16 output that sum rounded
once, a row's bits the same whatever batch it is in, segments the stacked weight's bits, and a shape it
does not take refused. Runs on any CPU with AVX512-BF16, AMX ones too (the engine uses AMX there)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import bf16_rows, derived_weights

pytestmark = pytest.mark.skipif(not bf16_rows.avx512_bf16(), reason="no AVX512-BF16 on this CPU")
bf = torch.bfloat16


def _case(m, n, k, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(bf)
    w = torch.randn(n, k, generator=g).to(bf)
    b = torch.randn(n, generator=g).to(bf) if bias else None
    return x, w, b


@pytest.mark.parametrize("m,n,k", [(1, 4, 32), (5, 96, 64), (6, 64, 256), (32, 128, 1536), (33, 68, 512),
                                   (256, 16, 96), (100, 8, 2048), (7, 12, 6144)])  # rows 4096 bytes apart: copied
def test_the_fp32_sums_are_within_their_rounding_bound(m, n, k):
    """Each lane sums k / 32 pairs (two roundings each), then four levels of a tree, then the bias: at
    most k / 16 + 5 roundings of 2^-24 on the way, each of at most the sum of |products| (+ |bias|)."""
    x, w, b = _case(m, n, k, seed=m + n + k)
    got = bf16_rows.avx512_linear_rows(x, derived_weights.rows_of(w), b, out_dtype=torch.float32)
    x64, w64, b64 = x.double(), w.double(), b.double()
    want = x64 @ w64.T + b64
    bound = (k / 16 + 5) * 2.0**-24 * (x64.abs() @ w64.abs().T + b64.abs())
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - want).abs() <= bound).all()


def test_the_bf16_output_is_the_fp32_sums_rounded_once():
    x, w, b = _case(20, 192, 320)
    rows = derived_weights.rows_of(w)
    f32 = bf16_rows.avx512_linear_rows(x, rows, b, out_dtype=torch.float32)
    assert torch.equal(bf16_rows.avx512_linear_rows(x, rows, b), f32.to(bf))


def test_a_rows_bits_do_not_depend_on_the_batch_around_it():
    """A row alone (a prefill's last row, a decode step of one) and in batches of every size give the same
    bits: an output's order of sums is fixed by its row and column, not by the block it falls in (the
    fp32 sums compared: a bf16 output would hide most of a difference in its rounding)."""
    x, w, b = _case(40, 64, 384)
    rows = derived_weights.rows_of(w)
    whole = bf16_rows.avx512_linear_rows(x, rows, b, out_dtype=torch.float32)
    for size in (1, 2, 5, 6, 7, 13, 32, 39):
        for start in (0, 40 - size):
            part = bf16_rows.avx512_linear_rows(x[start:start + size], rows, b, out_dtype=torch.float32)
            assert torch.equal(part, whole[start:start + size]), (size, start)


def test_rows_a_page_apart_keep_their_bits_when_copied_apart():
    """Rows of K = 2048 (4096 bytes) are copied a cache line further apart before a call of more than one
    row (bf16_rows.c's staggered_rows), in tiles past 96 rows: each row's bits are its bits alone."""
    x, w, b = _case(130, 32, 2048, seed=3)
    rows = derived_weights.rows_of(w)
    whole = bf16_rows.avx512_linear_rows(x, rows, b, out_dtype=torch.float32)
    for i in (0, 64, 97, 129):
        assert torch.equal(bf16_rows.avx512_linear_rows(x[i:i + 1], rows, b, out_dtype=torch.float32), whole[i:i + 1])


@pytest.mark.parametrize("m,kv_rows", [(9, 16), (20, 16), (20, 12)])  # 4 x 6 blocks; 8 x 3; 4 x 6 (12 rows)
def test_segments_give_the_stacked_weights_bits(m, kv_rows):
    """A layer's q/k/v read where each lies are the concatenated weight's product, bit for bit."""
    x, q, b = _case(m, 64, 256, seed=1)
    k_, v = torch.randn(kv_rows, 256).to(bf), torch.randn(8, 256).to(bf)
    f32 = torch.float32
    stacked = bf16_rows.avx512_linear_rows(x, derived_weights.rows_of(torch.cat([q, k_, v])), out_dtype=f32)
    assert torch.equal(bf16_rows.avx512_linear_rows(x, derived_weights.rows_of([q, k_, v]), out_dtype=f32), stacked)


def test_a_shape_it_does_not_take_is_refused_with_no_output_written():
    x, w, _ = _case(3, 6, 64)
    assert not bf16_rows.avx512_rows_fit([w])  # 6 rows: not whole blocks of 4
    with pytest.raises(ValueError, match="not taken"):
        bf16_rows.avx512_linear_rows(x, derived_weights.rows_of(w))
    assert bf16_rows.avx512_rows_fit([torch.zeros(8, 64, dtype=bf)] * 3)
    assert not bf16_rows.avx512_rows_fit([torch.zeros(8, 48, dtype=bf)])  # k % 32
    assert not bf16_rows.avx512_rows_fit([torch.zeros(8, 64)])  # fp32
    assert not bf16_rows.avx512_rows_fit([torch.zeros(64, 8, dtype=bf).t()])  # rows not contiguous
