"""The decoder layer's elementwise steps in C (engine/kernels/native/layer_glue.c) against the torch ops they
replace: the rotation and cache writes bit for bit, the bf16 norm and silu * up within the one bf16
rounding their header names, Gemma's norm and GELU * up within their arithmetic's bounds."""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import native_glue
from engine.models.attention import _rotate_sign
from engine.models.fused_layers import _rotate

BF16_EPS = torch.finfo(torch.bfloat16).eps


def _ready(dtype):
    if native_glue._fn("rope_cache", dtype) is None:
        pytest.skip("no C compiler here: the layers run torch's ops")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 40])  # 40: half a head is 20, 16 lanes and 4 alone
def test_rotation_and_cache_writes_are_torchs_bits(dtype, d):
    _ready(dtype)
    g = torch.Generator().manual_seed(0)
    t, h, kvh, slots = 37, 9, 3, 300
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=g) * 4).to(dtype)  # one GEMM's output, as fused_linears'
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)
    pos = torch.randint(0, 4000, (t,), generator=g).float()
    freqs = pos[:, None] / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype).view(t, 1, d), emb.sin().to(dtype).view(t, 1, d)
    sin_signed = sin * _rotate_sign(d, dtype, torch.device("cpu"))
    where = torch.randperm(slots, generator=g)[:t]
    k_slots, v_slots = torch.zeros(slots, kvh, d, dtype=dtype), torch.zeros(slots, kvh, d, dtype=dtype)
    q_rot, k_rot = native_glue.rope_cache(q, k, v, cos, sin_signed, where, k_slots, v_slots)
    want_q, want_k = _rotate(q, cos, sin_signed), _rotate(k, cos, sin_signed)
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    want_ks, want_vs = torch.zeros_like(k_slots), torch.zeros_like(v_slots)
    want_ks.index_copy_(0, where, want_k)
    want_vs.index_copy_(0, where, v)
    assert torch.equal(k_slots, want_ks) and torch.equal(v_slots, want_vs)


@pytest.mark.parametrize("n", [576, 100])  # 100: six vectors of 16 and 4 values alone
def test_add_and_norm_in_bf16_within_one_rounding(n):
    _ready(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(41, n, generator=g) * torch.logspace(-2, 2, 41)[:, None]).to(torch.bfloat16)
    r = torch.randn(41, n, generator=g).to(torch.bfloat16)
    w = torch.randn(n, generator=g).to(torch.bfloat16)
    h, y = native_glue.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, x + r)  # the residual add: one rounding, torch's
    want = w * F.rms_norm(h.float(), (n,), None, 1e-5).to(torch.bfloat16)
    ulp = BF16_EPS * want.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert ((y.float() - want.float()).abs() <= 2 * ulp).all()  # see test_llama_model's norm test
    assert (y != want).float().mean().item() < 0.01
    h2, y2 = native_glue.add_rms_norm(h, None, w, 1e-5)
    assert h2 is h and torch.equal(y2, y)  # without a residual: the norm alone


def test_silu_times_up_in_bf16_within_one_rounding():
    """silu(gate) is rounded to bf16 once by each (their e^x differ within an fp32 ulp or two, so
    the rounded silu differs by at most one bf16 ulp where it falls on a boundary), then times up,
    rounded: at most 2 bf16 ulp apart."""
    _ready(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(33, 2 * 1536, generator=g) * 6).to(torch.bfloat16)
    gate, up = gate_up.split(1536, dim=-1)
    got = native_glue.silu_mul(gate, up)
    want = F.silu(gate) * up
    ulp = BF16_EPS * want.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()
    assert (got != want).float().mean().item() < 0.01
    assert native_glue.silu_mul(gate.contiguous(), up.contiguous()) is None  # not one tensor's halves: torch's


def test_add_and_norm_and_silu_in_fp32_within_their_rounding():
    """fp32 (what a quantized engine's layers and the fp32 C decode loop run): the residual add is
    torch's; the norm differs from torch's only in its mean's summation order and a division for
    rsqrt (|error| <= (N + 4) u |y|), silu in its e^x (Cephes' vs SLEEF's, an ulp or two: 8 u)."""
    _ready(torch.float32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(41, 576, generator=g) * torch.logspace(-2, 2, 41)[:, None]
    r, w = torch.randn(41, 576, generator=g), torch.randn(576, generator=g)
    h, y = native_glue.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, x + r)
    want = F.rms_norm(h, (576,), w, 1e-5)
    assert ((y - want).abs() <= (576 + 4) * 2.0**-24 * want.abs() + 1e-30).all()
    h2, y2 = native_glue.add_rms_norm(h, None, w, 1e-5)
    assert h2 is h and torch.equal(y2, y)  # without a residual: the same sum, in the same order
    gate_up = torch.randn(7, 2 * 300, generator=g) * 4
    got = native_glue.silu_mul(gate_up[:, :300], gate_up[:, 300:])
    want = F.silu(gate_up[:, :300]) * gate_up[:, 300:]
    assert ((got - want).abs() <= 8 * 2.0**-24 * want.abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemmas_norm_against_hfs_module(dtype):
    """Gemma's (1 + w) norm against gemma_model.RMSNorm's torch ops (HF's Gemma3RMSNorm): in fp32 apart only
    by the mean's summation order and a division for rsqrt ((N + 6) u |y|); in bf16 the same fp32 value
    rounded once, so at most a bf16 ulp apart where it falls near a boundary (2 ulp allowed, rare)."""
    from engine.models.gemma_model import RMSNorm

    _ready(dtype)
    g = torch.Generator().manual_seed(5)
    n = 1152 + 7  # Gemma 3 1B's width, and a tail of 7 values alone
    x = (torch.randn(37, n, generator=g) * torch.logspace(-2, 2, 37)[:, None]).to(dtype)
    norm = RMSNorm(n, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g) * 0.5)
    want = norm(x.float().to(dtype)) if dtype == torch.float32 else norm(x)
    got = native_glue.gemma_norm(x, norm.weight, 1e-6)
    if dtype == torch.float32:
        assert ((got - want).abs() <= (n + 6) * 2.0**-24 * want.abs() + 1e-30).all()
    else:
        ulp = BF16_EPS * want.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
        assert ((got.float() - want.float()).abs() <= 2 * ulp).all()
        assert (got != want).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_times_up_against_torchs_tanh_gelu(dtype):
    """GELU's tanh form times up, as g / (1 + e^-2y): within a few fp32 ulps of torch's 0.5 g (1 + tanh(y))
    where tanh is far from -1; where it nears -1 torch's 1 + tanh loses digits to cancellation (an absolute
    error of a few u in it, times 0.5 |g|): |error| <= 8 u (|want| + 0.5 |g| |up|); bf16 rounds that once
    (2 ulp, rare)."""
    _ready(dtype)
    g = torch.Generator().manual_seed(6)
    i = 6912 + 5
    gate_up = (torch.randn(19, 2 * i, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(i, dim=-1)
    got = native_glue.silu_mul(gate, up, "gelu_tanh_mul")
    want = F.gelu(gate, approximate="tanh") * up
    slack = 8 * 2.0**-24 * (want.float().abs() + 0.5 * (gate.float() * up.float()).abs())
    if dtype == torch.float32:
        assert ((got - want).abs() <= slack + 1e-30).all()
    else:
        ulp = BF16_EPS * want.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
        assert ((got.float() - want.float()).abs() <= 2 * ulp + slack).all()
        clear = gate.float() > -2  # away from the cancellation: a rare boundary's flip only
        assert (got != want)[clear].float().mean().item() < 0.01


def test_what_the_kernels_do_not_take_goes_to_torch():
    x = torch.randn(4, 64)
    assert native_glue.add_rms_norm(x, None, torch.ones(64, dtype=torch.bfloat16), 1e-5) is None  # mixed dtypes
    assert native_glue.silu_mul(x[:, :32], x[:, 33:]) is None  # not one tensor's halves
    q = torch.randn(4, 2, 16, dtype=torch.float16)
    assert native_glue.rope_cache(q, q, q, q, q, torch.arange(4), q, q) is None
