"""engine/amx_linears.py: the tile layout (pure, runs anywhere) and, where the CPU has AMX, the
kernels: int8 bit for bit against the exact integer product scaled as the oneDNN path scales it,
bf16 within a bf16 GEMM's error bound, and the int8 engine's logits unchanged by the kernel swap."""

from __future__ import annotations

import pytest
import torch

from engine import amx_linears, int8_linears, native_kernels

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
