"""bench/expert_gemms.py's ways compute the same GEMMs: the panels, the dot products in place and torch's
grouped GEMM agree within an fp32 dot product's rounding (plus bf16's rounding of each output), so the
benchmark times the same work three ways; a wrong expert's weights fall outside that bound."""

import pytest
import torch

from engine.kernels import f32_linears


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_way_computes_the_same_expert_gemms(dtype):
    from bench.expert_gemms import ways

    if not f32_linears.available():
        pytest.skip("the fp32 kernel does not serve here")
    g = torch.Generator().manual_seed(0)
    e, h, i, rows = 4, 64, 96, 3
    layers = [((torch.randn(e, 2 * i, h, generator=g) * 0.1).to(dtype), (torch.randn(e, h, i, generator=g) * 0.1).to(dtype))
              for _ in range(2)]
    starts, experts = torch.arange(0, e * rows + 1, rows, dtype=torch.int64), torch.arange(e, dtype=torch.int64)
    x, act = torch.randn(e * rows, h, generator=g).to(dtype), torch.randn(e * rows, i, generator=g).to(dtype)
    gate_up, down = layers[-1]
    exact = [torch.cat([a[r * rows:(r + 1) * rows].double() @ w[r].double().T for r in range(e)])
             for a, w in ((x, gate_up), (act, down))]
    scale = [torch.cat([a[r * rows:(r + 1) * rows].double().abs() @ w[r].double().abs().T for r in range(e)])
             for a, w in ((x, gate_up), (act, down))]
    half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    with torch.inference_mode():
        for way, sweep in ways(layers, dtype).items():
            outs = (torch.empty(e * rows, 2 * i, dtype=dtype), torch.empty(e * rows, h, dtype=dtype))
            got = sweep(x, act, starts, experts, outs)
            for out, want, mag, k in zip(got, exact, scale, (h, i)):
                bound = k * 2.0**-24 * mag + half_ulp * want.abs()
                assert ((out.double() - want).abs() <= bound * 1.0001 + 1e-30).all(), way
            if way == "panels":
                wrong = sweep(x, act, starts, experts.roll(1), outs)[0].double()
                assert ((wrong - exact[0]).abs() > h * 2.0**-24 * scale[0] + half_ulp * exact[0].abs()).any()
