"""engine/kernels/w8_linears.py: weight-only int8 without AMX tiles multiplies, as integers (AVX512-VNNI or
AVX2), the weights q times scale exactly by the activations rounded to int16 as `int16_rows` says, within a
GEMM's error bound, each output's bits its own row's and column's alone (a row alone, in a batch, in another
block of rows), at any shape the packed copy takes (columns and K past whole chunks)."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from engine.kernels import amx_linears, int8_linears, native_kernels, w8_linears

w8_kernel = pytest.mark.skipif(not w8_linears.available(), reason="no AVX2 with FMA here")
# one row; a block of a few; columns and K past whole chunks of 32; two and three blocks of 12 rows; a prefill's
SHAPES = [(1, 192, 576), (7, 50, 100), (13, 96, 70), (32, 960, 576), (33, 576, 1536), (300, 64, 1536)]


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): int8 weights and their bf16 scale per group."""
    g = torch.Generator().manual_seed(seed)
    return int8_linears.quantize_groups(torch.randn(n, k, generator=g))


@w8_kernel
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_it_multiplies_the_weights_q_times_scale(m, n, k, out_dtype):
    q, scale = _weights(n, k, m + n * k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    x[:, ::7] *= 300  # outliers: the integer kernel rounds values 2^7 below a row's largest
    x = x.bfloat16()
    got = w8_linears.linear_w8(x, amx_linears.pack_w8(q, scale), out_dtype).double()
    # exact integer products a group; a rounding per group's fp32 sum
    xs, ws = w8_linears.int16_rows(x), _exact_weights(q, scale)
    exact = xs @ ws.t()
    # k fp32 roundings of the running sum at most, then the output's own
    magnitude = xs.abs() @ ws.abs().t()
    last = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-23
    assert ((got - exact).abs() <= k * 2.0**-24 * magnitude + last * exact.abs() + 1e-30).all()


def _exact_weights(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q times its group's scale, in fp64 (exact): the integer kernel's weights."""
    return q.double() * scale.double().repeat_interleave(amx_linears.W8_GROUP, dim=1)[:, : q.shape[1]]


@w8_kernel
def test_the_integer_kernels_activations_are_rounded_as_int16_rows_says():
    """A row's values within 2^7 of its largest are exact, smaller ones round to 2^-15 of it: against the
    rows unrounded the outputs move by that much, and against int16_rows' values by no more than the sums'
    roundings (a kernel that rounded to 8 bits, or by the wrong power of two, fails one of the two)."""
    q, scale = _weights(64, 512, 3)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
    x[:, 5] = torch.tensor([1e3, -3e4, 2.0**-30, 7.0])  # rows whose largest value sits far above the rest
    x = x.bfloat16()
    got = w8_linears.linear_w8(x, amx_linears.pack_w8(q, scale), torch.float32).double()
    ws = _exact_weights(q, scale)
    rounded = w8_linears.int16_rows(x)
    assert (rounded - x.double()).abs().max(dim=1).values.le(x.double().abs().amax(dim=1) * 2.0**-15).all()
    exact = rounded @ ws.t()
    assert ((got - exact).abs() <= 64 * 2.0**-24 * (rounded.abs() @ ws.abs().t()) + 1e-30).all()
    assert not torch.equal(rounded, x.double())  # the test rounds something


@w8_kernel
def test_a_row_holding_an_inf_or_a_nan_spoils_that_row_alone():
    q, scale = _weights(40, 96, 5)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(6)).bfloat16()
    x[0, 3], x[2, 90] = float("inf"), float("nan")
    got = w8_linears.linear_w8(x, amx_linears.pack_w8(q, scale), torch.float32)
    assert not got[0].isfinite().any() and not got[2].isfinite().any()
    assert torch.equal(got[1], w8_linears.linear_w8(x[1:2], amx_linears.pack_w8(q, scale), torch.float32)[0])
    assert got[1].isfinite().all()


@w8_kernel
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_are_its_own_whatever_the_batch(out_dtype):
    """Alone, first, last, or in the second or third block of rows (a block alone or several, each a
    different pass over the weights): the same bits, so a row prefilled and decoded agree."""
    q, scale = _weights(100, 1536, 1)
    packed = amx_linears.pack_w8(q, scale)
    x = torch.randn(30, 1536, generator=torch.Generator().manual_seed(2)).bfloat16()
    batch = w8_linears.linear_w8(x, packed, out_dtype)
    for row in (0, 13, 29):
        assert torch.equal(w8_linears.linear_w8(x[row:row + 1], packed, out_dtype)[0], batch[row])
    assert torch.equal(w8_linears.linear_w8(x.flip(0), packed, out_dtype), batch.flip(0))


def test_the_kernel_builds_wherever_the_cpu_has_avx2_and_fma():
    """So that a kernel that fails to compile fails here, not skips every test above."""
    if {"avx2", "fma"} <= native_kernels.cpu_flags() and native_kernels.enabled() and native_kernels._compiler():
        assert w8_linears.available()


@pytest.mark.skipif(not {"avx512_vnni", "avx512bw"} <= native_kernels.cpu_flags(), reason="no AVX512-VNNI here")
def test_avx512_vnni_gives_the_bits_avx2_gives(tmp_path):
    """The same sums in the same order on VPDPWSSD as on VPMADDWD (w8_madd.h): w8_linear.c built for AVX2
    alone on this CPU gives this CPU's build's bits, a block of rows, several, and one row."""
    lib = tmp_path / "w8_avx2.so"
    cc = native_kernels._compiler()
    flags = [*native_kernels.FLAGS, "-mno-avx512f"]
    subprocess.run([cc, *flags, "-o", str(lib), f"{native_kernels.SOURCE_DIR}/w8_linear.c", "-lm"], check=True,
                   capture_output=True)
    avx2 = ctypes.CDLL(str(lib)).w8_linear_f32
    avx2.argtypes, avx2.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_int64, ctypes.c_void_p], ctypes.c_int
    for m, n, k in [(1, 96, 576), (9, 50, 100), (33, 576, 1536)]:
        q, scale = _weights(n, k, m)
        packed = amx_linears.pack_w8(q, scale)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
        x[:, ::7] *= 300
        x = x.bfloat16()
        want = torch.empty(m, n)
        assert avx2(x.data_ptr(), m, k, packed.packed.data_ptr(), n, want.data_ptr()) == 0
        assert torch.equal(w8_linears.linear_w8(x, packed, torch.float32), want)


def test_the_c_loop_takes_the_amx_kernel_where_it_runs_else_this_one():
    bf16, f32 = w8_linears.c_kernels()
    want = "amx_linear" if amx_linears.available() else "w8_linear"
    assert bf16[0] == want == f32[0] and bf16[1].endswith("_bf16") and f32[1].endswith("_f32")


@w8_kernel
def test_the_int8_engine_picks_it_where_there_are_no_amx_tiles():
    want = "amx_w8" if amx_linears.available() else "w8"
    assert int8_linears.kernel() == (want, 127)
