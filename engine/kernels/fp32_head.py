"""The LM head in fp32 for an engine serving in bf16 or fp16 (`EngineConfig.head_dtype="float32"`,
vLLM's `hf_overrides={"head_dtype": "float32"}`; issue 65 item 3).

The logits are the policy's log-probabilities one softmax away, and a half-precision head rounds
each of them to 8 (bf16) or 11 (fp16) bits: ScaleRL measured a better asymptote from the fp32 head
alone. Here the head's weight stays the parameter the engine holds (a tied embedding's too: pushes,
checksums and deltas read it as before); its forward reads a derived copy of it upcast to fp32
(exact) and packed for the fp32 kernels where they run (engine/kernels/packed_linears.pack_weight),
multiplies the hidden states upcast to fp32 (exact), and returns fp32 logits, so no logit is
rounded to the model's dtype. A push stages the copy from its staged weights and swaps it in at
its commit, as every derived copy (engine/kernels/derived_weights.py).
"""

from __future__ import annotations

import functools
import logging
import types

import torch

from engine.kernels import derived_weights, f32_linears, packed_linears

log = logging.getLogger(__name__)



def install(model: torch.nn.Module) -> bool:
    """Route `model`'s output embedding (its LM head) through an fp32 copy of its weight; False
    where the head is fp32 already (nothing to do)."""
    head = model.get_output_embeddings()
    if head.weight.dtype == torch.float32:
        return False
    cpu = head.weight.device.type == "cpu"
    if cpu and packed_linears.supported(torch.float32):
        derive = functools.partial(packed_linears.pack_weight, dtype=torch.float32)
        derive.takes_parts = True
    else:  # CUDA, or a CPU without oneDNN's fp32 linears: the upcast weight itself
        derive = _upcast
    derived_weights.attach(head, derive)
    head._apply_derived = _apply
    head.forward = types.MethodType(_forward, head)
    head._fp32_plain = derive is _upcast
    log.info("LM head in fp32 (a %s copy of its %s weight)", "packed" if derive is not _upcast else "plain",
             head.weight.dtype)
    return True


def _upcast(weight):
    parts = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    return torch.cat([w.float() for w in parts]) if len(parts) > 1 else parts[0].float().contiguous()


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and self.weight.requires_grad:
        return torch.nn.functional.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
    return _apply(self, x, derived_weights.current(self), self.bias)


def _apply(self: torch.nn.Linear, x: torch.Tensor, copy, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., hidden] (any dtype) @ the fp32 copy's transpose (+ bias): fp32 logits."""
    rows = x.reshape(-1, x.shape[-1]).float()
    b = None if bias is None else bias.float()
    if isinstance(copy, f32_linears.F32Weight):  # our AVX-512 kernel's panels
        out = f32_linears.linear(rows, copy, b)
    elif self._fp32_plain:  # the upcast weight itself
        out = torch.nn.functional.linear(rows, copy, b)
    else:  # oneDNN's reordered weight
        out = packed_linears.blocked_linear(rows, copy, b)
    return out.reshape(*x.shape[:-1], out.shape[-1])
