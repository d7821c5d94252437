"""The model's linear layers on CUDA in fp8 (e4m3), derived from the full-precision weights a trainer
pushes (issue 49 item 4; `EngineConfig.quantization="fp8"`): FP8-RL's W8A8 on verl, written beside
the CPU's int8 (engine/kernels/int8_linears.py) with the same rules.

The full-precision parameter stays the truth (checksums, digests, deltas, host copies, healing,
peer catch-up and LoRA read it); the fp8 copy is a cache beside it in the module's `_fp8`, made by
the pure `derive(weight)`: per-output-channel scales (a row's largest |w| maps to e4m3's 448).
Activations are quantized per token at each forward, so a row's output depends on that row alone.
The product is `torch._scaled_mm` with row-wise scales (Hopper, compute capability 9.0; Ada's 8.9
runs it too), which needs bf16 out: an fp32 engine's output is widened back. Linears whose sizes
are not multiples of 16 (what _scaled_mm takes) stay in full precision.

The copy is a derived copy (engine/kernels/derived_weights.py): made from a push's staged weights and
swapped in at its commit; each forward compares the weight's data pointer, version and shape with
those it derived from."""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from engine.kernels.int8_linears import KEEP_FULL_PRECISION
from engine.kernels import derived_weights

E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8Weight:
    """An fp8 copy of a [N, K] weight: w ~ q * scale. `q_t`: [K, N], column-major (q.t() of a
    row-major q, what _scaled_mm's second operand must be); `scale`: [1, N] fp32."""

    q_t: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        k, n = self.q_t.shape
        return n * k + 4 * n


def supported(device: torch.device | str = "cuda") -> bool:
    """Whether `device` runs fp8 matmuls (compute capability 8.9 or more)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, scale fp32 [rows, 1]): per row, symmetric, the row's largest |t| at E4M3_MAX."""
    t = t.float()
    scale = t.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(E4M3_MAX)
    return torch.div(t, scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def derive(weight: torch.Tensor) -> Fp8Weight:
    """The fp8 copy of `weight` ([N, K], on its device). Pure: reads the weight, writes nothing."""
    q, scale = quantize(weight.detach())
    return Fp8Weight(q.t(), scale.t().contiguous())


def matmul(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) @ w, in bf16."""
    q, scale = quantize(x)
    if bias is not None and bias.dtype != torch.bfloat16:
        bias = bias.to(torch.bfloat16)
    return torch._scaled_mm(q, w.q_t, scale_a=scale, scale_b=w.scale, bias=bias, out_dtype=torch.bfloat16)


def install(model: torch.nn.Module, keep: tuple[str, ...] = KEEP_FULL_PRECISION) -> int:
    """Route every `nn.Linear` of `model` (but those in `keep`, or of sizes _scaled_mm does not take)
    through an fp8 copy of its weight; returns how many. Raises RuntimeError off a capable GPU."""
    device = next(model.parameters()).device
    if not supported(device):
        raise RuntimeError(f"fp8 linears need a CUDA GPU of compute capability 8.9 or more (Hopper, Ada), "
                           f"not {device}")
    count = 0
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in keep
                and module.in_features % 16 == 0 and module.out_features % 16 == 0):
            derived_weights.attach(module, derive)
            module._eight_bit_bytes = module.weight.numel() + 4 * module.weight.shape[0]  # and a scale a row
            module._apply_derived = _fp8_apply
            module.forward = types.MethodType(_fp8_forward, module)
            count += 1
    return count


def _fp8_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and self.weight.requires_grad:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return _fp8_apply(self, x, derived_weights.current(self), self.bias)


def _fp8_apply(self: torch.nn.Linear, x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """x through the fp8 copy `w`: the module's own, or its group's (engine/kernels/fused_linears.py)."""
    out = matmul(x.reshape(-1, x.shape[-1]), w, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
