"""Runs a HF causal LM on the engine's paged KV cache: packs a step's sequences into one batch,
runs the forward, samples."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from engine import attention
from engine.config import EngineConfig
from engine.logits_processors import build_edits, sequence_bans
from engine.sampler import Penalties, SamplingTensors, TopLogprobs, sample, token_ranks, uniform_noise
from engine.sequence import Sequence

log = logging.getLogger(__name__)


# Prompt positions turned into logprobs at once: bounds the [chunk, V] float32 temporaries (a
# 4k-token prompt at a 152k vocabulary would be ~2.5 GB per [T, V] tensor)
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, tuple[float, int]]] | None = None  # per row {id: (logprob, rank)}: see entries


def entries(tokens: list[int], values: list[float], ranks: list[int], top_ids: list[list[int]],
            top_values: list[list[float]], ks: list[int]) -> list[dict[int, tuple[float, int]]]:
    """Per position {token id: (logprob, rank)}: the sampled (or prompt) token first, then its k
    most likely (vLLM's shape; a token among the top k takes its place's rank)."""
    out = []
    for tok, lp, rank, ids, vals, k in zip(tokens, values, ranks, top_ids, top_values, ks):
        entry = {tok: (lp, rank)}
        entry.update((i, (v, j + 1)) for j, (i, v) in enumerate(zip(ids[:k], vals[:k])))
        out.append(entry)
    return out


def _column(params: list, name: str, device, dtype=torch.float32) -> torch.Tensor:
    """One sampling parameter of every row, as a tensor on the device."""
    return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_device(spec: str, current_cuda_index=None) -> torch.device:
    """The engine's device with its index: "cuda" alone means this process's current CUDA device
    (`torch.cuda.set_device` and NCCL need an index; `current_cuda_index` is for tests)."""
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        index = current_cuda_index() if current_cuda_index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
    return device


def load_model(cfg: EngineConfig, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        cfg.model, dtype=cfg.torch_dtype, attn_implementation=attention.register()
    )
    return model.to(device).eval()


def decode_chunks(num_blocks: list[int], min_rows: int = 16) -> list[tuple[int, int, int]]:
    """Cut a batch sorted by block count into (start, end, blocks) chunks: one per distinct
    count, a chunk of fewer than `min_rows` rows merged into the next (longer) one, so the
    padding stays small and the per-chunk overhead bounded."""
    chunks, start = [], 0
    for i, nb in enumerate(num_blocks):
        last = i + 1 == len(num_blocks)
        if last or (num_blocks[i + 1] != nb and i + 1 - start >= min_rows):
            chunks.append((start, i + 1, nb))
            start = i + 1
    return chunks


def kv_cache_blocks(budget_bytes: int, per_block: int, want: int, min_blocks: int) -> int:
    """KV blocks to allocate: enough for every running sequence at full length (`want`) if the
    budget holds them, else what it holds; never fewer than one full-length sequence needs
    (raises when even that does not fit)."""
    fits = max(0, budget_bytes) // per_block
    if fits < min_blocks:
        raise ValueError(f"the KV cache budget ({budget_bytes / 2**30:.2f} GiB) holds {fits} blocks, fewer than "
                         f"one sequence of max_model_len needs ({min_blocks}): lower max_model_len or raise "
                         "gpu_memory_utilization / kv_cache_memory_gb")
    return min(want, fits)


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda":  # this process's current device: kernels, NCCL and allocations land here
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            # Always set it, even to torch's own default: left unset, a core process next to a
            # busy parent ran small steps 20x slower (OpenMP workers stalling each other).
            torch.set_num_threads(cfg.num_threads or available_cpus())
        self.model = load_model(cfg, self.device)
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        self.num_layers = mc.num_hidden_layers
        self.num_kv_heads = mc.num_key_value_heads
        self.head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.block_size = cfg.block_size
        self.num_blocks = self._num_blocks()
        self.allocate_kv_cache()
        # noise is drawn where the logits are: no batch x vocab copy to the device per step
        self.shared_generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.forward_seconds = 0.0
        self.prompt_rows: dict[int, tuple[int, int]] = {}  # seq_id -> (first row, length), one prefill
        self.prompt_logprobs: dict[int, list] = {}  # seq_id -> its prompt logprobs, taken by the core
        self.decode_chunk_min_rows = 16  # see decode_chunks
        # One attention call for a whole fresh prefill (block-diagonal causal mask) on GPUs, where
        # launches cost; on the CPU the per-sequence calls do less arithmetic (sum of L^2, not T^2).
        self.packed_prefill = self.device.type == "cuda"
        self.lora_bank = None  # unmerged LoRA adapters (engine/lora_bank.py), set by the worker
        self.row_versions: list[int] | None = None  # the adapter version of each sequence of the last step

    def _num_blocks(self) -> int:
        cfg = self.cfg
        per_block = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        per_block *= torch.finfo(cfg.torch_dtype).bits // 8
        min_blocks = -(-cfg.max_model_len // self.block_size)
        if cfg.num_kv_blocks is not None:
            if cfg.num_kv_blocks < min_blocks:
                raise ValueError(
                    f"num_kv_blocks={cfg.num_kv_blocks} cannot hold one sequence of max_model_len="
                    f"{cfg.max_model_len} tokens (needs {min_blocks} blocks of {self.block_size})"
                )
            return cfg.num_kv_blocks
        return kv_cache_blocks(self._kv_budget_bytes(per_block * min_blocks), per_block, cfg.max_num_seqs * min_blocks,
                               min_blocks)

    def _kv_budget_bytes(self, one_sequence: int) -> int:
        """What the KV cache may take: on CUDA, gpu_memory_utilization of the GPU less what is in
        use already (the weights, other processes); on CPU, kv_cache_memory_gb (a cap of the
        automatic size: one full-length sequence always gets room)."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(total * self.cfg.gpu_memory_utilization) - (total - free)
        return max(int(self.cfg.kv_cache_memory_gb * 2**30), one_sequence)

    def allocate_kv_cache(self) -> None:
        self._gather = None  # decode's gather buffers, see _gather_buffers
        shape = (self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.cfg.torch_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.cfg.torch_dtype, device=self.device)

    def free_kv_cache(self) -> None:
        self.k_cache = self.v_cache = self._gather = None

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _prepare_prefill(self, seqs: list[Sequence]):
        ids, pos, slots, spans, last = [], [], [], [], []
        offset = 0
        for seq in seqs:
            start, end = seq.num_computed_tokens, len(seq)
            ids.extend(seq.token_ids[start:end])
            pos.append(torch.arange(start, end))
            slots.append(self._slots(seq, start, end))
            table = torch.tensor(seq.block_table, device=self.device) if start else None
            spans.append((offset, offset + end - start, start, table))
            if seq.wants_prompt_logprobs:  # every position of this prompt: see prompt_logprobs
                self.prompt_rows[seq.seq_id] = (len(last), end - start)
                last.extend(range(offset, offset + end - start - 1))
            offset += end - start
            last.append(offset - 1)
        dev = self.device
        packed = None
        if self.packed_prefill and len(spans) > 1 and all(computed == 0 for _, _, computed, _ in spans):
            packed = attention.packed_causal_mask([(a, b) for a, b, _, _ in spans], dev)
        ctx = attention.AttnContext(
            is_prefill=True,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            slot_mapping=self._to_device(torch.cat(slots)),
            prefill_spans=spans,
            packed_mask=packed,
        )
        return (self._to_device(torch.tensor(ids)), self._to_device(torch.cat(pos)), ctx,
                self._to_device(torch.tensor(last)))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Step inputs to the device; on CUDA through pinned memory, without blocking the host."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _prepare_decode(self, seqs: list[Sequence]):
        """Inputs of a decode step, its rows sorted by block count (see attention.py). Returns the
        order too: row i of the step is seqs[order[i]]."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].block_table))
        seqs = [seqs[i] for i in order]
        lens = torch.tensor([len(s) for s in seqs])
        pos = lens - 1
        slots = torch.tensor([s.block_table[(len(s) - 1) // self.block_size] for s in seqs]) * self.block_size
        slots += pos % self.block_size
        dev = self.device
        chunks, widest = [], 0
        for start, end, nb in decode_chunks([len(s.block_table) for s in seqs], self.decode_chunk_min_rows):
            table = torch.zeros(end - start, nb, dtype=torch.long)
            for i, s in enumerate(seqs[start:end]):
                table[i, : len(s.block_table)] = torch.tensor(s.block_table)
            mask = torch.arange(nb * self.block_size) < lens[start:end].unsqueeze(1)
            chunks.append(attention.DecodeChunk(start, end, table.flatten().to(dev), nb, mask[:, None, None, :].to(dev)))
            widest = max(widest, (end - start) * nb)
        k_buf, v_buf = self._gather_buffers(widest)
        ctx = attention.AttnContext(
            is_prefill=False,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            slot_mapping=slots.to(dev),
            decode_chunks=chunks,
            gather_k=k_buf,
            gather_v=v_buf,
        )
        ids = torch.tensor([s.token_ids[-1] for s in seqs], device=dev)
        return ids, pos.to(dev), ctx, order

    def _gather_buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode's gather buffers, kept between steps and grown on demand."""
        buf = self._gather
        if buf is None or buf[0].shape[0] < num_blocks:
            shape = (num_blocks, *self.k_cache.shape[2:])
            buf = self._gather = (
                torch.empty(shape, dtype=self.k_cache.dtype, device=self.k_cache.device),
                torch.empty(shape, dtype=self.k_cache.dtype, device=self.k_cache.device),
            )
        return buf

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """Logits [B, V] (float32) of the next token of each sequence."""
        self.prompt_rows = {}
        if is_prefill:
            ids, pos, ctx, keep = self._prepare_prefill(seqs)
            order = None
        else:
            ids, pos, ctx, order = self._prepare_decode(seqs)
            keep = None
        attention.set_context(ctx)
        self.row_versions = None
        if self.lora_bank is not None:
            rows = [len(s) - s.num_computed_tokens for s in seqs] if is_prefill else [1] * len(seqs)
            in_rows = seqs if order is None else [seqs[i] for i in order]
            self.lora_bank.assign(in_rows, rows if order is None else [1] * len(seqs))
            self.row_versions = [s.lora_version for s in seqs] if self.lora_bank.active else None
        t0 = time.perf_counter()
        try:
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=pos.unsqueeze(0),
                use_cache=False,
                logits_to_keep=keep if keep is not None else 0,
            )
            logits = out.logits[0].float()
            if self.prompt_rows:
                logits = self._take_prompt_logprobs(seqs, logits)
            if order is not None:  # back to the caller's order
                logits = torch.empty_like(logits).index_copy_(0, torch.tensor(order, device=logits.device), logits)
            # NOTE: no device sync here: the sampled tokens' trip to the host is the step's one
            # sync point. On CUDA, forward_seconds is thus the host's side of the forward only.
        finally:
            attention.set_context(None)
            if self.lora_bank is not None:
                self.lora_bank.end_step()
        self.forward_seconds += time.perf_counter() - t0
        return logits

    def _take_prompt_logprobs(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """For the sequences that asked for prompt logprobs, turn their prompt rows into
        `self.prompt_logprobs[seq_id]` (vLLM's shape: None for the first token, then {token:
        (logprob, rank)} plus the top k, from the model's raw distribution); return one row per sequence."""
        keep = torch.ones(logits.shape[0], dtype=torch.bool)
        for seq in seqs:
            if seq.seq_id not in self.prompt_rows:
                continue
            first, length = self.prompt_rows.pop(seq.seq_id)
            keep[first : first + length - 1] = False
            entries_ = []
            for start in range(1, length, PROMPT_LOGPROBS_CHUNK):
                end = min(length, start + PROMPT_LOGPROBS_CHUNK)
                entries_ += self._prompt_entries(logits[first + start - 1 : first + end - 1], seq.token_ids[start:end],
                                                 seq.params.prompt_logprobs)
            self.prompt_logprobs[seq.seq_id] = [None, *entries_]
        return logits[keep.to(logits.device)]

    @staticmethod
    def _prompt_entries(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, tuple[float, int]]]:
        """Entries of a chunk of prompt positions: the next token's logprob and rank, the top k."""
        rows = torch.log_softmax(logits, dim=-1)
        chosen = rows.gather(-1, torch.tensor(targets, device=rows.device).unsqueeze(-1)).squeeze(-1)
        top = rows.topk(k, dim=-1)
        return entries(targets, chosen.tolist(), token_ranks(rows, chosen).tolist(), top.indices.tolist(),
                       top.values.tolist(), [k] * len(targets))

    @torch.inference_mode()
    def probe(self, num_tokens: int = 4) -> bool:
        """A forward of a fixed input on a scratch one-block cache (the real cache and its
        sequences are untouched): True if every logit is finite. For health checks."""
        n = min(num_tokens, self.block_size)
        scratch = (self.num_layers, 1, self.block_size, self.num_kv_heads, self.head_dim)
        dev = self.device
        ctx = attention.AttnContext(
            is_prefill=True,
            k_cache=torch.zeros(scratch, dtype=self.cfg.torch_dtype, device=dev),
            v_cache=torch.zeros(scratch, dtype=self.cfg.torch_dtype, device=dev),
            slot_mapping=torch.arange(n, device=dev),
            prefill_spans=[(0, n, 0, None)],
        )
        ids = torch.arange(n, device=dev) % self.vocab_size
        attention.set_context(ctx)
        try:
            logits = self.model(input_ids=ids.unsqueeze(0), position_ids=torch.arange(n, device=dev).unsqueeze(0),
                                use_cache=False, logits_to_keep=1).logits
        finally:
            attention.set_context(None)
        return bool(torch.isfinite(logits).all())

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded sequence's own generator, on this device (sample i of n uses seed + i)."""
        if seq.generator is None and seq.params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed + seq.index)
        return seq.generator

    @torch.inference_mode()
    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SampleResult:
        t = self.sampling_tensors(seqs, logits.shape[-1])
        tokens, logprobs, top = sample(logits, t)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        return SampleResult(tokens, logprobs, None if top is None else self._top_entries(seqs, tokens, logprobs, top))

    @staticmethod
    def _top_entries(seqs: list[Sequence], tokens: list[int], logprobs: list[float], top: TopLogprobs):
        """Each row's own k of the batch's widest K (None for a row that asked for none)."""
        ks = [s.params.logprobs or 0 for s in seqs]
        rows = entries(tokens, logprobs, top.sampled_ranks.tolist(), top.ids.tolist(), top.values.tolist(), ks)
        return [row if s.params.logprobs is not None else None for s, row in zip(seqs, rows)]

    def sampling_tensors(self, seqs: list[Sequence], vocab: int) -> SamplingTensors:
        params = [s.params for s in seqs]
        dev = self.device

        def column(name: str, dtype=torch.float32) -> torch.Tensor:
            return _column(params, name, dev, dtype)

        t = SamplingTensors(column("temperature"), raw_logprobs=self.cfg.logprobs_mode == "raw")
        t.any_greedy = any(p.greedy for p in params)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        t.num_top_logprobs = max(asked) if asked else None
        t.edits = self.logits_edits(seqs, vocab)
        if any(p.top_k for p in params):
            t.top_k = column("top_k", torch.long)
        if any(p.top_p < 1 for p in params):
            t.top_p = column("top_p")
        if any(p.min_p > 0 for p in params):
            t.min_p = column("min_p")
        if any(p.penalised for p in params):
            t.penalties = self.penalties(seqs, vocab)
        if not all(p.greedy for p in params):
            t.uniforms = uniform_noise([self.generator(s) for s in seqs], self.shared_generator, dev)
        return t

    def logits_edits(self, seqs: list[Sequence], vocab: int):
        """allowed_token_ids, bans (bad words, min_tokens) and logit_bias of this step's rows."""
        rows = []
        for s in seqs:
            p = s.params
            if p.allowed_token_ids is None and not p.logit_bias and not s.min_tokens_bans and not s.bad_words:
                rows.append((None, (), None))
                continue
            bans = sequence_bans(s.num_output_tokens, p.min_tokens, s.min_tokens_bans, s.output_token_ids, s.bad_words)
            rows.append((p.allowed_token_ids, bans, p.logit_bias))
        return build_edits(rows, vocab, self.device)

    def penalties(self, seqs: list[Sequence], vocab: int) -> Penalties:
        """Each row's output-token counts and prompt-token mask, built on the device from the
        token ids (only in steps where some row has a penalty)."""
        dev, rows = self.device, len(seqs)
        counts = torch.zeros(rows, vocab, device=dev)
        prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=dev)
        for i, s in enumerate(seqs):
            if s.params.penalised:
                out = torch.tensor(s.output_token_ids, dtype=torch.long, device=dev)
                counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
                prompt[i, torch.tensor(s.token_ids[: s.num_prompt_tokens], dtype=torch.long, device=dev)] = True
        params = [s.params for s in seqs]
        return Penalties(*(_column(params, name, dev) for name in ("repetition_penalty", "presence_penalty",
                                                                   "frequency_penalty")), counts, prompt)
