"""The start-up profile a GPU's KV budget subtracts (engine/gpu_memory.py): the largest prefill an
engine takes and a batch's sampling, run on a scratch cache before the real one is allocated, with
torch's allocator reporting what they held. A decode row's memory is measured apart (sampling's
growth per row, plus its gather buffers at full width), so the budget can bound the rows by the
blocks the cache serves (gpu_memory.rows_beside_cache)."""

from __future__ import annotations

import torch

from engine.models import attention
from engine.sampler import SamplingTensors, sample, uniform_noise
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

PROFILE_ROWS = 256  # rows the profile samples to measure a row's memory


def peak_bytes(runner) -> tuple[int, int]:
    """(the most memory `runner` holds beside its KV cache, the bytes each decode row adds) on CUDA,
    measured over `profile_step` with the real cache not yet allocated: the peak of its prefill and
    of sampling PROFILE_ROWS rows, and the sampling's growth per row plus a row's gather buffers at
    full width (computed: they are plain tensors)."""
    dev = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    rows = min(runner.max_num_seqs, PROFILE_ROWS)
    prefill_peak, sampling_base, sampling_peak = profile_step(runner, rows)
    torch.cuda.empty_cache()
    per_row = -(-max(0, sampling_peak - sampling_base) // rows)
    if not runner.native_decode:
        max_blocks = -(-runner.cfg.max_model_len // runner.block_size)
        per_row += max_blocks * runner.per_block // runner.num_layers  # one layer's keys and values
    return max(prefill_peak, sampling_base), per_row


@torch.inference_mode()
def profile_step(runner, rows: int | None = None) -> tuple[int, int, int]:
    """The largest prefill `runner` takes, on a scratch cache of one full-length sequence (every
    span writes there; the real cache is untouched): the most tokens a step holds, in spans of
    max_model_len; then sampling of `rows` rows (default max_num_seqs) with top-p (the sort's
    temporaries). On CUDA returns the bytes allocated at the prefill's peak, when the sampling
    began and at its peak (zeros elsewhere)."""
    cfg, dev, bs = runner.cfg, runner.device, runner.block_size
    max_blocks = -(-cfg.max_model_len // bs)
    saved = runner.k_cache, runner.v_cache, runner._cache_views, runner._gather
    runner.k_cache = torch.zeros((runner.num_layers, max_blocks, bs, runner.num_kv_heads, runner.head_dim),
                                 dtype=cfg.torch_dtype, device=dev)
    runner.v_cache = torch.zeros_like(runner.k_cache)
    runner._cache_views = attention.cache_views(runner.k_cache, runner.v_cache)
    runner._gather = None
    tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
    whole, rest = divmod(tokens, cfg.max_model_len)
    seqs = []
    for n in [cfg.max_model_len] * whole + ([rest] if rest else []):
        seq = Sequence("profile", 0, [0] * n, SamplingParams(), bs)
        seq.share_table(list(range(-(-n // bs))))  # each layer's view of the scratch cache, whatever its group
        seqs.append(seq)
    try:
        ids, pos, ctx, keep = runner._prepare_prefill(seqs)
        attention.set_context(ctx)
        logits = runner.model(input_ids=ids.unsqueeze(0), position_ids=pos.unsqueeze(0), use_cache=False,
                              logits_to_keep=keep).logits[0].float()
        one = logits[:1].clone()
        del logits
        prefill_peak, sampling_base = _allocated_since_reset(dev)
        rows = rows or cfg.max_num_seqs
        logits = one.expand(rows, -1).contiguous()
        t = SamplingTensors(torch.ones(rows, device=dev), top_p=torch.full((rows,), 0.9, device=dev),
                            uniforms=uniform_noise(runner.shared_generator, rows, dev), any_greedy=False)
        sample(logits, t)
        return prefill_peak, sampling_base, _allocated_since_reset(dev)[0]
    finally:
        attention.set_context(None)
        runner.k_cache, runner.v_cache, runner._cache_views, runner._gather = saved


def _allocated_since_reset(dev: torch.device) -> tuple[int, int]:
    """(the most bytes allocated since the last call, the bytes allocated now) on CUDA; the peak
    starts over. Zeros elsewhere."""
    if dev.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(dev)
    peak, now = torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    return peak, now
