"""engine/kernels/lora_merge.py: the merge into a kept buffer gives the bits of PEFT's own arithmetic
(`weight.data += get_delta_weight()`), in one dtype and with fp32 factors into a bf16 base (a
trainer's adapter into a bf16 engine), and leaves W0 as it was."""

import pytest
import torch

from engine.kernels import lora_merge, native_kernels
from engine.kernels.lora_merge import _native_add, delta, merge


# (1000, 333): threads' chunks that end mid-row and a last chunk shorter than the rest, rows merged
# two at a time with a masked tail; (97, 256): an odd row merged alone, K in whole blocks; a scale
# that is no power of two rounds in the scaling step, which an FMA would skip
@pytest.mark.parametrize("shape,scale", [((96, 80), 2.0), ((1000, 333), 0.37), ((97, 256), 0.37)])
@pytest.mark.parametrize("base,factors", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "mm-then-add"])
def test_a_merge_into_a_kept_buffer_has_pefts_bits(base, factors, shape, scale, one_pass, monkeypatch):
    """Both native ways: the whole merge in one pass (where its sums are torch.mm's here, probed),
    and torch's mm then the one-pass scale-and-add (elsewhere)."""
    if native_kernels.enabled():  # the native passes are what is under test where kernels build
        assert _native_add() is not None
    if not one_pass:
        monkeypatch.setattr(lora_merge, "fused_matches_mm", lambda: False)
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(*shape, generator=g).to(base)
    a = (torch.randn(16, shape[1], generator=g) * 0.1).to(factors)
    b = (torch.randn(shape[0], 16, generator=g) * 0.1).to(factors)
    keep = w0.clone()
    want = w0.clone()
    want += delta(a, b, scale)  # PEFT: weight.data += delta, rounded once to the weight's dtype
    out = torch.full_like(w0, float("nan"))
    got = merge(w0, a, b, scale, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want) and torch.equal(w0, keep)
    assert not torch.equal(got, w0)  # the adapter did move the weights


def test_the_one_pass_merge_is_taken_on_this_cpu():
    """On the CPUs it was written on (MKL's sgemm sums a small K as r FMAs in order) the probe takes
    the one-pass merge; elsewhere it says so, and the two-pass merge (tested above) serves."""
    if not native_kernels.enabled() or lora_merge._merge_rows() is None:
        pytest.skip("no native kernels here")
    if not lora_merge.fused_matches_mm():
        pytest.skip("this CPU's BLAS sums B @ A otherwise: the two-pass merge serves")
    w0, a, b = torch.randn(64, 128), torch.randn(16, 128), torch.randn(64, 16)
    out = torch.empty_like(w0)
    assert lora_merge._fused(a, b, 0.5, w0, out) and torch.equal(out, torch.mm(b, a).mul_(0.5).add_(w0))
