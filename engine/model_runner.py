"""Runs a HF causal LM on the engine's paged KV cache: packs a step's sequences into one batch,
runs the forward, samples. Beside it: how many cache blocks it gets (kv_cache_size.py), how a
step's inputs are packed (step_inputs.py), prompt logprobs (prompt_logprobs.py)."""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import replace

import numpy as np
import torch

from engine import decode_graphs, gpu_memory, kv_groups, memory_profile, routed_experts, step_inputs, step_sampling
from engine.kernels import native_decode, zero_pages
from engine.models import attention, moe_model
from engine.config import EngineConfig
from engine.kv_cache_size import bytes_per_block, group_blocks
from engine.models.model_loader import load_model
from engine.kernels.native_decode import NativeDecode
from engine.prompt_logprobs import take_prompt_logprobs
from engine.sampler import sample
from engine.step_sampling import SampleResult
from engine.sequence import Sequence

log = logging.getLogger(__name__)


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
        try:
            self.model = load_model(cfg, self.device)
            self._set_up(cfg)
        except BaseException:
            self.release()  # a failed start leaves no weights nor buffers on the device (the process lives on)
            raise

    def _set_up(self, cfg: EngineConfig) -> None:
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        self.num_layers = mc.num_hidden_layers
        self.num_kv_heads = mc.num_key_value_heads
        self.head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.block_size = cfg.block_size
        self.k_cache = self.v_cache = self._gather = self._cache_views = self.kv_caches = None
        self.native_decode = native_decode.available(cfg.torch_dtype, self.device, mc.num_attention_heads,
                                                     self.num_kv_heads, self.head_dim)
        # noise is drawn where the logits are: no batch x vocab copy to the device per step
        self.shared_generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.forward_seconds = 0.0
        self.prompt_rows: dict[int, tuple[int, int]] = {}  # seq_id -> (first row, length), one prefill
        self.prompt_logprobs: dict[int, list] = {}  # seq_id -> its prompt logprobs, taken by the core
        self.routed: dict[int, np.ndarray] = {}  # seq_id -> the step's routed-expert rows, taken by the core
        self.sparse_blocks = moe_model.sparse_blocks(self.model)  # engine/models/moe_model.py's, in layer order
        # its layers' KV cache groups (engine/kv_groups.py): one, or the full-attention layers' and the
        # windowed ones' where they mix; a windowed group's blocks behind the window go back early
        self.kv_groups = kv_groups.of_windows(kv_groups.layer_windows(self.model) or [None] * self.num_layers,
                                              hybrid=not cfg.disable_hybrid_kv_cache_manager)
        self.decode_chunk_cost = 1.0  # scales a chunk's overhead in chunk_cuts (0: a chunk per block count)
        self._key_positions = None  # arange over key positions, for decode masks
        self._logits_fp32 = None  # the step's fp32 logits on the CPU, kept between steps (_fp32_logits)
        # One attention call for a whole prefill (its spans padded to one shape) on GPUs, where
        # launches cost; on the CPU the per-span calls do less arithmetic.
        self.padded_prefill = self.device.type == "cuda"
        self.lora_bank = None  # unmerged LoRA adapters (engine/lora_bank.py), set by the worker
        self.row_versions: list[int] | None = None  # the adapter version of each sequence of the last step
        element = torch.finfo(cfg.torch_dtype).bits // 8
        group_per_block = [bytes_per_block(len(self.kv_groups.layers(g)), self.block_size, self.num_kv_heads,
                                           self.head_dim, element) for g in range(len(self.kv_groups.windows))]
        self.per_block = sum(group_per_block)  # a block's tokens over every layer
        # the most rows a step runs: max_num_seqs, lowered where the cache cannot serve that many
        # (on CUDA by the memory a row takes beside the cache: _kv_budget_bytes)
        self.max_num_seqs = cfg.max_num_seqs
        # decode on CUDA graphs (engine/decode_graphs.py): their pad rows write into one block of their own;
        # ROLLOUT_DECODE_GRAPHS=eager runs their static buffers and padding without capturing, on any device
        # (the CPU's tests of the bookkeeping), =off never
        mode = os.environ.get("ROLLOUT_DECODE_GRAPHS", "capture" if self.device.type == "cuda" else "off")
        if mode == "eager":
            self.native_decode = False
        why_not = decode_graphs.unsupported(self) if mode != "off" else "off"
        self.graph_mode = "off" if why_not else mode
        if mode != "off" and why_not:
            log.info("decode steps run eagerly: %s", why_not)
        self.decode_graphs = None
        # on CUDA after a profile run, which needs all of the above
        self.group_blocks = group_blocks(cfg, group_per_block, list(self.kv_groups.windows), self._kv_budget_bytes)
        self.num_blocks = self.group_blocks[0]
        self.max_num_seqs = min(self.max_num_seqs, *self.group_blocks)  # each running sequence holds a block
        if self.max_num_seqs < cfg.max_num_seqs:
            log.warning("max_num_seqs=%d lowered to %d: the KV cache (%s blocks) serves no more sequences at once",
                        cfg.max_num_seqs, self.max_num_seqs, " + ".join(map(str, self.group_blocks)))
        self.allocate_kv_cache()

    def release(self) -> None:
        """Drops the weights, the cache and every buffer, and hands a GPU's cached memory back."""
        self.model = None
        self.free_kv_cache()
        self._logits_fp32 = self._key_positions = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _kv_budget_bytes(self, one_sequence: int) -> int:
        """What the KV cache may take: on CUDA, gpu_memory_utilization of the GPU's total less
        this engine's measured peak beside the cache (engine/gpu_memory.py); on CPU,
        kv_cache_memory_gb (a cap of the automatic size: one full-length sequence always gets room)."""
        if self.device.type != "cuda":
            return max(int(self.cfg.kv_cache_memory_gb * 2**30), one_sequence)
        peak, per_row = memory_profile.peak_bytes(self)
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = self.weight_bytes() if self.cfg.reserve_push_staging else 0
        budget = gpu_memory.kv_budget_bytes(total, free, self.cfg.gpu_memory_utilization,
                                            torch.cuda.memory_reserved(self.device), peak, reserve)
        self.max_num_seqs, cache = gpu_memory.rows_beside_cache(budget, self.per_block, per_row, self.max_num_seqs)
        return cache

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _spare(self, group: int) -> bool:
        """A block past the group's block manager's: decode graphs' pad rows write into it, and a windowed
        group's block tables point at it where their blocks went back early (read, never seen: behind the
        window)."""
        return self.graph_mode != "off" or self.kv_groups.windows[group] is not None

    @property
    def pad_slots(self) -> list[int]:
        """The cache slot decode graphs' pad rows write into, in each KV cache group: its spare block's first."""
        return [blocks * self.block_size for blocks in self.group_blocks]

    def allocate_kv_cache(self) -> None:
        self._gather = None  # decode's gather buffers, see _gather_buffers
        self.kv_caches = []  # per group: (keys, values) [its layers, its blocks, bs, kvh, d]
        for g, blocks in enumerate(self.group_blocks):
            shape = (len(self.kv_groups.layers(g)), blocks + int(self._spare(g)), self.block_size, self.num_kv_heads,
                     self.head_dim)
            self.kv_caches.append((zero_pages.zeros(shape, self.cfg.torch_dtype, self.device),  # CPU: resident as used
                                   zero_pages.zeros(shape, self.cfg.torch_dtype, self.device)))
        self.k_cache, self.v_cache = self.kv_caches[0]
        self._cache_views = attention.grouped_cache_views(self.kv_caches, self.kv_groups.layer_group)
        if self.graph_mode != "off":
            self.decode_graphs = decode_graphs.DecodeGraphs(self, capture=self.graph_mode == "capture")

    def free_kv_cache(self) -> None:
        self.k_cache = self.v_cache = self._gather = self._cache_views = self.decode_graphs = self.kv_caches = None

    def graph_stats(self) -> dict:
        """How decode steps run: "off" (eagerly), "capture" (CUDA graphs), "eager" (their buffers,
        uncaptured); graphs held, captured and replayed so far."""
        g = self.decode_graphs
        return {"mode": self.graph_mode, "held": 0 if g is None else len(g.graphs),
                "captured": 0 if g is None else g.captures, "replayed": 0 if g is None else g.replays}

    def weights_changed(self) -> None:
        """Called by the worker whenever the weights were written or replaced."""
        if self.decode_graphs is not None:
            self.decode_graphs.weights_changed()

    def _prepare_prefill(self, seqs: list[Sequence]):
        """Inputs of a prefill step, packed on the host and sent in one copy: token ids,
        positions, cache slots, the rows whose logits are kept, the block tables of the spans
        that extend a cached prefix, and on GPUs the padded layout of one attention call; the
        slots and tables once per KV cache group (engine/kv_groups.py), each group's in its context."""
        bs, groups = self.block_size, range(len(self.kv_groups.windows))
        ids, pos, last, spans = [], [], [], []
        slots, tables = [[] for _ in groups], [[] for _ in groups]
        offset = n_tables = 0
        for seq in seqs:
            start, end = seq.num_computed_tokens, len(seq)
            p = np.arange(start, end)
            ids.append(np.asarray(seq.token_ids[start:end], dtype=np.int64))
            pos.append(p)
            for g in groups:
                table = np.asarray(seq.tables[g], dtype=np.int64)
                slots[g].append(table[p // bs] * bs + p % bs)
                if start:  # attends to its cached prefix: its block table goes along
                    tables[g].append(table)
            table_at = None
            if start:  # (where in each group's tables)
                table_at = (n_tables, len(seq.block_table))
                n_tables += len(seq.block_table)
            spans.append((offset, offset + end - start, start, table_at))
            if seq.wants_prompt_logprobs:  # every position of this prompt: see prompt_logprobs
                self.prompt_rows[seq.seq_id] = (sum(len(x) for x in last), end - start)
                last.append(np.arange(offset, offset + end - start - 1))
            offset += end - start
            last.append(np.array([offset - 1]))
        t, n_last, n_groups = offset, sum(len(x) for x in last), len(groups)
        padded = [step_inputs.padded_layout(seqs, spans, t, bs, g) for g in groups] if self.padded_prefill else [None]
        extra = [] if padded[0] is None else [x for layout in padded for x in layout[:4]]
        buf = step_inputs.upload(np.concatenate([*ids, *pos, *(x for g in slots for x in g), *last,
                                                 *(x for g in tables for x in g), *extra]), self.device)
        ids_d, pos_d = buf[:t], buf[t : 2 * t]
        last_d = buf[(2 + n_groups) * t : (2 + n_groups) * t + n_last]
        rest = buf[(2 + n_groups) * t + n_last :]
        extra_at = n_groups * n_tables
        contexts = []
        for g in groups:
            table = rest[g * n_tables : (g + 1) * n_tables]
            ctx = attention.AttnContext(is_prefill=True, k_cache=self.k_cache, v_cache=self.v_cache,
                                        slot_mapping=buf[(2 + g) * t : (3 + g) * t], **self._cache_views,
                                        prefill_spans=[(a, b, c, None if at is None else table[at[0] : at[0] + at[1]])
                                                       for a, b, c, at in spans])
            if self.native_decode and self.cfg.batch_invariant:  # each row attends as a decode row (attention._prefill)
                ctx.native = step_inputs.prefill_rows(seqs, pos, t, g)
            if padded[0] is not None:
                size = sum(len(x) for x in padded[g][:4])
                ctx.padded_prefill = step_inputs.padded_on_device(rest[extra_at : extra_at + size], *padded[g][4:], bs)
                extra_at += size
            contexts.append(ctx)
        return ids_d, pos_d, self._by_layer(contexts), last_d

    def _by_layer(self, contexts: list[attention.AttnContext]) -> attention.AttnContext:
        """The step's context: the first group's, holding each layer's group's (the same masks for all)."""
        ctx = contexts[0]
        if len(contexts) > 1:
            for other in contexts[1:]:
                other.span_masks = ctx.span_masks
            ctx.layer_ctx = [contexts[g] for g in self.kv_groups.layer_group]
        return ctx

    def decode_order(self, seqs: list[Sequence]) -> list[Sequence]:
        """A decode batch in the order the step wants its rows: by block count (see chunk_cuts)."""
        return sorted(seqs, key=lambda s: len(s.block_table))

    def _prepare_decode(self, seqs: list[Sequence]):
        """Inputs of a decode step (rows sorted by block count: decode_order), all sent in one
        copy; the attention's chunks cut where padding costs more than a chunk. A context per KV cache
        group (its slots and tables), each layer reading its group's."""
        groups = range(len(self.kv_groups.windows))
        buf, layout = step_inputs.pack_decode(seqs, self.block_size, len(groups))
        dev = self.device
        inputs = layout.views(step_inputs.upload(buf, dev))
        lengths, tables = inputs["lengths"], inputs["group_tables"]
        contexts = [attention.AttnContext(is_prefill=False, k_cache=self.k_cache, v_cache=self.v_cache,
                                          slot_mapping=inputs["group_slots"][g], **self._cache_views) for g in groups]
        if self.native_decode:  # the C kernel reads the blocks in place: no chunks, no gather
            longest = max(len(s) for s in seqs)
            for ctx, table in zip(contexts, tables):
                ctx.native = NativeDecode(table, lengths, longest)
            return inputs["ids"], inputs["positions"], self._by_layer(contexts)
        widths = [len(s.block_table) for s in seqs]
        cuts = step_inputs.chunk_cuts(widths, self.decode_chunk_overhead_rows)
        if self._key_positions is None or self._key_positions.numel() < layout.width * self.block_size:
            width = max(layout.width, -(-self.cfg.max_model_len // self.block_size))
            self._key_positions = torch.arange(width * self.block_size, device=dev)
        k_buf, v_buf = self._gather_buffers(max((end - start) * nb for start, end, nb in cuts))
        bs = self.block_size
        for ctx in contexts:
            ctx.decode_chunks = []
        for start, end, nb in cuts:
            mask = self._key_positions[: nb * bs] < lengths[start:end, None]
            # the CPU's SDPA turns a bool mask into an additive one at every call: once a step, not per layer
            mask = attention.as_mask(mask, self.k_cache.dtype if dev.type == "cpu" else torch.bool)
            chunk = attention.decode_chunk(start, end, tables[0][start:end, :nb].reshape(-1), nb, mask, k_buf, v_buf,
                                           lengths[start:end])
            for g, ctx in enumerate(contexts):  # the same rows, masks and buffers; each group's blocks (row after row)
                ctx.decode_chunks.append(chunk if g == 0 else replace(chunk, blocks=tables[g][start:end, :nb].reshape(-1)))
        return inputs["ids"], inputs["positions"], self._by_layer(contexts)

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

    @property
    def decode_chunk_overhead_rows(self) -> float:
        """One more decode chunk's cost in block-rows of KV gathered (see chunk_cuts)."""
        per_block_row = 2 * self.block_size * self.num_kv_heads * self.head_dim * self.k_cache.element_size()
        return step_inputs.CHUNK_OVERHEAD_BYTES[self.device.type] / per_block_row * self.decode_chunk_cost

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """Logits [B, V] (float32) of the next token of each sequence. A decode batch must come
        in `decode_order`."""
        self.prompt_rows = {}
        if not is_prefill and self.decode_graphs is not None:
            t0 = time.perf_counter()
            logits = self.decode_graphs.forward(seqs)
            if logits is not None:
                self.routed, self.row_versions = {}, None
                self.forward_seconds += time.perf_counter() - t0
                return logits
        if is_prefill:
            ids, pos, ctx, keep = self._prepare_prefill(seqs)
        else:
            ids, pos, ctx = self._prepare_decode(seqs)
            keep = None
        attention.set_context(ctx)
        self.row_versions = None
        if self.lora_bank is not None:
            rows = [len(s) - s.num_computed_tokens for s in seqs] if is_prefill else [1] * len(seqs)
            self.lora_bank.assign(seqs, rows)
            self.row_versions = [s.lora_version for s in seqs] if self.lora_bank.active else None
        t0 = time.perf_counter()
        try:
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=pos.unsqueeze(0),
                use_cache=False,
                logits_to_keep=keep if keep is not None else 0,
            )
            logits = self._fp32_logits(out.logits[0])
            if self.prompt_rows:
                logits = take_prompt_logprobs(seqs, logits, self.prompt_rows, self.prompt_logprobs)
            self.routed = routed_experts.take(seqs, is_prefill, self.sparse_blocks)
            # NOTE: no device sync here: the sampled tokens' trip to the host is the step's one
            # sync point. On CUDA, forward_seconds is thus the host's side of the forward only.
        finally:
            attention.set_context(None)
            if self.lora_bank is not None:
                self.lora_bank.end_step()
        self.forward_seconds += time.perf_counter() - t0
        return logits

    def _fp32_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits in fp32. On the CPU into a buffer kept between steps (grown when a step
        needs more): a 256-row step's are 50 MB, past malloc's mmap threshold, and fresh pages each step
        were 2% of a bf16 MoE decode step zeroing them. The step's sampling reads them and keeps none
        of them (sample returns new tensors), so the next step may overwrite them. A step with more
        rows than a decode step's most (a prefill asking for its prompt's logprobs) gets fresh memory:
        the kept buffer stays at a decode step's size."""
        n = logits.numel()
        if (logits.dtype == torch.float32 or logits.device.type != "cpu"
                or n > self.max_num_seqs * logits.shape[-1]):
            return logits.float()
        if self._logits_fp32 is None or self._logits_fp32.numel() < n:
            self._logits_fp32 = torch.empty(n, dtype=torch.float32)
        return self._logits_fp32[:n].view(logits.shape).copy_(logits)

    @torch.inference_mode()
    def probe(self, num_tokens: int = 4) -> bool:
        """A forward of a fixed input on a scratch one-block cache (the real cache and its
        sequences are untouched): True if every logit is finite. For health checks."""
        n = min(num_tokens, self.block_size)
        scratch = (self.num_layers, 1, self.block_size, self.num_kv_heads, self.head_dim)
        dev = self.device
        k = torch.zeros(scratch, dtype=self.cfg.torch_dtype, device=dev)
        v = torch.zeros_like(k)
        ctx = attention.AttnContext(is_prefill=True, k_cache=k, v_cache=v, slot_mapping=torch.arange(n, device=dev),
                                    prefill_spans=[(0, n, 0, None)], **attention.cache_views(k, v))
        ids = torch.arange(n, device=dev) % self.vocab_size
        attention.set_context(ctx)
        try:
            logits = self.model(input_ids=ids.unsqueeze(0), position_ids=torch.arange(n, device=dev).unsqueeze(0),
                                use_cache=False, logits_to_keep=1).logits
        finally:
            attention.set_context(None)
        return bool(torch.isfinite(logits).all())

    @torch.inference_mode()
    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SampleResult:
        t = step_sampling.sampling_tensors(seqs, logits.shape[-1], self.device, self.shared_generator,
                                           raw_logprobs=self.cfg.logprobs_mode == "raw")
        tokens, logprobs, top = sample(logits, t)
        # one trip to the host for both (a sync on a GPU): token ids are exact in float64
        tokens, logprobs = torch.stack([tokens.double(), logprobs.double()]).tolist()
        tokens = [int(x) for x in tokens]
        top_rows = None if top is None else step_sampling.top_entries(seqs, tokens, logprobs, top)
        return SampleResult(tokens, logprobs, top_rows)
