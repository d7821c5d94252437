"""sampler.sample's common case (an RL rollout's step: every row sampled at its temperature, nothing
else asked) through engine/kernels/native/sample_rows.c: two passes over each row's logits instead of
about eight torch ops over the whole [B, V]: at 256 rows of SmolLM2's 49k vocabulary 5-6 ms a step
against 50-68 ms (bench.sampler; the fp32 logits' two reads at the memory's speed). The same
sampling rule as sampler.inverse_cdf (see the C file), its probabilities closer to float64's."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import native_kernels

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens [B] int64, logprobs [B] fp32) of logits [B, V] at temperature [B] (> 0) from one
    uniform in (0, 1] a row (float64), with blocks of `block` columns; None where no kernel takes it
    (not a CPU tensor of fp32 or bf16, no compiler), or where a row found no weight (the torch path
    then samples the step)."""
    if logits.device.type != "cpu" or logits.dtype not in _SUFFIX or logits.dim() != 2:
        return None
    fn = native_kernels.function("sample_rows", f"sample_rows_{_SUFFIX[logits.dtype]}",
                                 (_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR), ctypes.c_int)
    if fn is None:
        return None
    logits = logits.contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    uniforms = uniforms.to(torch.float64).contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    if fn(logits.data_ptr(), rows, vocab, temperature.data_ptr(), uniforms.data_ptr(), block, tokens.data_ptr(),
          logprobs.data_ptr()) != 0 or bool((tokens < 0).any()):
        return None
    return tokens, logprobs


def score_rows(logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor,
               block: int) -> torch.Tensor | None:
    """The logprobs [B] (fp32) `sample_rows` reports when row b of logits [B, V] at temperature [B] (> 0)
    samples tokens[b]: the same arithmetic, so the same bits; None where no kernel takes it."""
    if logits.device.type != "cpu" or logits.dtype not in _SUFFIX or logits.dim() != 2:
        return None
    fn = native_kernels.function("sample_rows", f"score_rows_{_SUFFIX[logits.dtype]}",
                                 (_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR), ctypes.c_int)
    if fn is None:
        return None
    logits = logits.contiguous()
    rows, vocab = logits.shape
    temperature = temperature.to(torch.float32).contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    if tokens.shape != (rows,) or temperature.shape != (rows,) or bool(((tokens < 0) | (tokens >= vocab)).any()):
        raise ValueError(f"score_rows takes one token in [0, {vocab}) and one temperature a row of {rows}")
    logprobs = torch.empty(rows, dtype=torch.float32)
    if fn(logits.data_ptr(), rows, vocab, temperature.data_ptr(), tokens.data_ptr(), block, logprobs.data_ptr()) != 0:
        return None
    return logprobs
