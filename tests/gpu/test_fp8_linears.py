"""fp8 linears on CUDA (engine/kernels/fp8_linears.py), run where a Hopper (or Ada) GPU is
(`python -m pytest -m gpu tests/gpu`); skipped elsewhere."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import derived_weights, fp8_linears
from engine.models.model_loader import quantized_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fp8_linears.supported("cuda"),
                                                  reason="needs a CUDA GPU of compute capability 8.9+")]

E4M3_ULP = 2.0**-3  # e4m3 keeps 3 mantissa bits: a rounding moves a value by at most 2^-4 of it, relative


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|fp8 - exact| per output: each operand rounds to e4m3 within half an ulp (2^-4 relative) of
    itself, or within half the smallest subnormal step near 0 (scaled by its row's amax / 448), so
    each product moves by at most |x||w| (2 * 2^-4 + 2^-8) plus the subnormal terms; the bf16 output
    adds 2^-8 of the largest possible sum."""
    k = x.shape[-1]
    ax, aw = x.abs().amax(-1, keepdim=True), w.abs().amax(-1)
    rel = 2 * 2.0**-4 + 2.0**-8
    sub = 2.0**-10 / 448  # half e4m3's smallest subnormal (2^-9), over the scale's 448
    return k * ax * aw * (rel + 2 * sub) + 2.0**-8 * k * ax * aw


def test_the_fp8_product_is_within_what_e4m3_rounding_allows():
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    assert fp8_linears.install(torch.nn.Sequential(layer)) == 1
    for rows in (1, 17, 300):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        want = x.double() @ layer.weight.double().t()
        assert ((layer(x).double() - want).abs() <= _bound(x.double(), layer.weight.double())).all()


def test_the_copy_follows_the_weight_and_derive_is_pure():
    layer = torch.nn.Linear(64, 32, bias=False, device="cuda").requires_grad_(False)
    fp8_linears.install(torch.nn.Sequential(layer))
    x = torch.randn(4, 64, device="cuda")
    before = layer.weight.clone()
    layer(x)
    assert torch.equal(layer.weight, before)
    first = layer._derived
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 64, device="cuda"))
    layer(x)
    assert layer._derived is not first
    derived_weights.drop(layer)
    assert layer._derived is None


def test_an_fp8_engine_serves_from_its_copy_and_keeps_the_weights(qwen2_dir):
    llm = LLM(EngineConfig(model=qwen2_dir, device="cuda", dtype="bfloat16", max_model_len=256, quantization="fp8"))
    model = llm.core.runner.model
    assert quantized_bytes(model) > 0 and next(model.parameters()).dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
