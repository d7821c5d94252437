"""engine/lora_merge.py: the merge into a kept buffer gives the bits of PEFT's own arithmetic
(`weight.data += get_delta_weight()`), in one dtype and with fp32 factors into a bf16 base (a
trainer's adapter into a bf16 engine), and leaves W0 as it was."""

import pytest
import torch

from engine.lora_merge import delta, merge


@pytest.mark.parametrize("base,factors", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_a_merge_into_a_kept_buffer_has_pefts_bits(base, factors):
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(96, 80, generator=g).to(base)
    a, b = (torch.randn(16, 80, generator=g) * 0.1).to(factors), (torch.randn(96, 16, generator=g) * 0.1).to(factors)
    keep = w0.clone()
    want = w0.clone()
    want += delta(a, b, 2.0)  # PEFT: weight.data += delta, rounded once to the weight's dtype
    out = torch.full_like(w0, float("nan"))
    got = merge(w0, a, b, 2.0, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want) and torch.equal(w0, keep)
    assert not torch.equal(got, w0)  # the adapter did move the weights
