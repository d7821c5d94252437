"""The LM head in fp32 for an engine serving in bf16 or fp16 (`EngineConfig.head_dtype="float32"`,
vLLM's `hf_overrides={"head_dtype": "float32"}`; issue 65 item 3).

The logits are the policy's log-probabilities one softmax away, and a half-precision head rounds
each of them to 8 (bf16) or 11 (fp16) bits: ScaleRL measured a better asymptote from the fp32 head
alone. Here the head's weight stays the parameter the engine holds (a tied embedding's too: pushes,
checksums and deltas read it as before), and the logits come out in fp32, never rounded to the
model's dtype: where the bf16 weight runs on AMX tiles in place, the tiles' fp32 sums are stored as
they are (every bf16 x bf16 product is exact in fp32, so this is the fp32 GEMM of the upcast
operands, at the bf16 head's speed); elsewhere the forward reads a derived copy of the weight
upcast to fp32 (exact), packed for the fp32 kernels where they run, and multiplies the upcast
hidden states. A push stages such a copy from its staged weights and swaps it in at its commit, as
every derived copy (engine/kernels/derived_weights.py).
"""

from __future__ import annotations

import functools
import logging
import types

import torch

from engine.kernels import bf16_rows, derived_weights, f32_linears, packed_linears

log = logging.getLogger(__name__)


def install(model: torch.nn.Module, max_seqs: int | None = None) -> bool:
    """Route `model`'s output embedding (its LM head) through an fp32 copy of its weight; False
    where the head is fp32 already (nothing to do)."""
    head = model.get_output_embeddings()
    if head.weight.dtype == torch.float32:
        return False
    cpu, head._fp32_head_plain = head.weight.device.type == "cpu", False
    if packed_linears.reads_in_place(head.weight, torch.bfloat16, max_seqs):
        # AMX tiles (or AVX512-BF16) on the bf16 weight in place, the fp32 sums stored unrounded: every bf16
        # product is exact in fp32, so this is the fp32 GEMM of the upcast operands at the bf16 head's speed
        derived_weights.attach(head, derived_weights.rows_of, in_place=True)
        kind = "bf16 kernel on the weight in place, fp32 sums"
    elif cpu and packed_linears.supported(torch.float32):
        derive = functools.partial(packed_linears.pack_weight, dtype=torch.float32)
        derive.takes_parts = True
        derived_weights.attach(head, derive)
        kind = "a packed copy, fp32 sums (our fp32 kernel's panels in the weight's bf16, or oneDNN's in fp32)"
    else:  # CUDA, or a CPU without oneDNN's fp32 linears: the upcast weight itself
        derived_weights.attach(head, _upcast)
        kind, head._fp32_head_plain = "an fp32 copy", True  # _apply's F.linear on it
    head._apply_derived = _apply
    head.forward = types.MethodType(_forward, head)
    log.info("LM head in fp32: %s", kind)
    return True


def _upcast(weight: torch.Tensor) -> torch.Tensor:
    return weight.float().contiguous()


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and self.weight.requires_grad:
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(x.float(), self.weight.float(), bias)
    return _apply(self, x, derived_weights.current(self), self.bias)


def _apply(self: torch.nn.Linear, x: torch.Tensor, copy, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., hidden] (any dtype) @ the fp32 copy's transpose (+ bias): fp32 logits."""
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(copy, derived_weights.WeightRows):  # bf16 in place (install): exact upcasts, fp32 sums
        out = bf16_rows.linear_rows(rows.to(torch.bfloat16), copy, bias, out_dtype=torch.float32)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    rows = rows.float()
    b = None if bias is None else bias.float()
    if isinstance(copy, f32_linears.F32Weight):  # our fp32 kernel's panels (bf16 ones widened as loaded)
        out = f32_linears.linear(rows, copy, b)
    elif self._fp32_head_plain:  # the upcast weight itself (_upcast)
        out = torch.nn.functional.linear(rows, copy, b)
    else:  # oneDNN's reordered weight
        out = packed_linears.blocked_linear(rows, copy, b)
    return out.reshape(*x.shape[:-1], out.shape[-1])
