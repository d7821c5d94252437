"""Decode steps replayed from CUDA graphs, so a GPU does not wait for the host's ~200 launches a step.

A decode step's forward is captured once per bucket of (rows, block-table width)
(engine/decode_buckets.py), lazily: the first step that needs a bucket captures it (logged), every
later one copies its packed inputs into the static buffer the graph reads and replays it. Sampling
stays eager (it reads the graph's logits rows of the real sequences), as do prefills, steps past
the largest bucket, and what a graph cannot hold: LoRA adapters kept unmerged (their rows change
per step), a mixture of experts (routing recorded on the host), transformers' own layers (their
masks synchronise with the host). `--enforce-eager` turns graphs off.

A graph reads the tensors it was captured with: the weights, their derived copies, the KV cache,
the static inputs and the gather buffers (allocated once, at their largest). A push that copies
into the weights' storage (commit "copy", what a worker with graphs asks for) and into its derived
copies' (an 8-bit copy staged by the push, laid out as the one served) keeps them valid;
whenever weights are written (`weights_changed`), stale derived copies are made at once (a replay
runs no Python that would make them) and, if any tensor a graph reads has moved (a swap, a
reload), the graphs are dropped and captured again as steps need them. Freeing the cache (sleep)
drops them too.

With `capture=False` (the CPU's tests) the same static buffers and padding run eagerly: every
step of the bookkeeping but the capture itself.
"""

from __future__ import annotations

import logging

import torch

from engine import decode_buckets
from engine.kernels import derived_weights
from engine.models import attention, llama_model
from engine.step_inputs import DecodeLayout, pack_decode

log = logging.getLogger(__name__)


def unsupported(runner) -> str | None:
    """Why decode steps of `runner` cannot run on graphs (None: they can)."""
    if runner.cfg.enforce_eager:
        return "enforce_eager"
    if runner.cfg.lora_versions:
        return "unmerged LoRA versions (lora_versions > 0)"
    if runner.sparse_blocks:
        return "a mixture of experts (routing is recorded on the host)"
    if not isinstance(runner.model, llama_model.CausalLM):
        return "transformers' own layers (their masks synchronise with the host)"
    if runner.native_decode:
        return "the CPU's C decode kernel"
    return None


class DecodeGraphs:
    def __init__(self, runner, capture: bool = True):
        self.runner = runner
        self.capture = capture
        bs = runner.block_size
        self.rows = decode_buckets.row_buckets(runner.max_num_seqs)
        self.widths = decode_buckets.width_buckets(-(-runner.cfg.max_model_len // bs))
        most_rows, most_blocks = self.rows[-1], self.widths[-1]
        dev = runner.device
        self.groups = len(runner.kv_groups.windows)  # a slot and a table per KV cache group (engine/kv_groups.py)
        size = DecodeLayout(most_rows, most_blocks, self.groups).size
        self.inputs = torch.zeros(size, dtype=torch.int64, device=dev)  # what every graph reads its step from
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=capture)
        self.key_positions = torch.arange(most_blocks * bs, device=dev)
        self.k_buf, self.v_buf = runner._gather_buffers(most_rows * most_blocks)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0  # graphs captured so far (a test's and a log's count)
        self.replays = 0
        self.weights_read: tuple[int, ...] | None = None  # where they were when the graphs held were captured

    def forward(self, seqs) -> torch.Tensor | None:
        """Logits [len(seqs), V] (float32) of a decode step in `decode_order`, or None when no
        bucket holds it (the caller runs it eagerly)."""
        runner = self.runner
        buf, layout = pack_decode(seqs, runner.block_size, self.groups)
        rows = decode_buckets.bucket_of(layout.rows, self.rows)
        width = decode_buckets.bucket_of(layout.width, self.widths)
        if rows is None or width is None:
            return None
        packed = decode_buckets.pad_decode(buf, layout, rows, width, runner.pad_slots)
        n = packed.size
        # through a pinned buffer kept between steps: the step's sampled tokens (its sync) have come
        # back before the next step writes it, so the copy it queued is done
        self.host[:n].numpy()[:] = packed
        self.inputs[:n].copy_(self.host[:n], non_blocking=self.capture)
        entry = self.graphs.get((rows, width))
        if entry is None:
            entry = self.graphs[rows, width] = self._capture(rows, width)
        elif self.capture:
            entry[0].replay()
            self.replays += 1
        else:
            entry = self.graphs[rows, width] = (None, self._step(rows, width))
        return entry[1][: layout.rows]

    def _step(self, rows: int, width: int) -> torch.Tensor:
        """The forward of a (rows x width) decode step on the static buffers: what a graph holds."""
        runner, bs = self.runner, self.runner.block_size
        views = DecodeLayout(rows, width, self.groups).views(self.inputs)
        mask = self.key_positions[: width * bs] < views["lengths"][:, None]
        contexts = []
        for slots, table in zip(views["group_slots"], views["group_tables"]):
            chunk = attention.decode_chunk(0, rows, table.reshape(-1), width, mask, self.k_buf, self.v_buf,
                                           views["lengths"])
            contexts.append(attention.AttnContext(is_prefill=False, k_cache=runner.k_cache, v_cache=runner.v_cache,
                                                  slot_mapping=slots, decode_chunks=[chunk], **runner._cache_views))
        attention.set_context(runner._by_layer(contexts))
        try:
            out = runner.model(input_ids=views["ids"].unsqueeze(0), position_ids=views["positions"].unsqueeze(0),
                               use_cache=False, logits_to_keep=0)
            return out.logits[0].float()
        finally:
            attention.set_context(None)

    def _capture(self, rows: int, width: int) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor]:
        """The bucket's graph and its output, captured now. The step's own inputs are in the static
        buffer already: the warm-up runs (and the replay after the capture writes) this step's keys
        and values into its own slots, the same bits twice."""
        self.captures += 1
        if self.weights_read is None:
            self.weights_read = self._weights_read()
        if not self.capture:
            return None, self._step(rows, width)
        log.info("capturing the decode graph of %d rows x %d blocks (%d so far)", rows, width, self.captures)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisations (cuBLAS workspaces) outside the capture
            self._step(rows, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(rows, width)
        graph.replay()
        return graph, logits

    def _weights_read(self) -> tuple[int, ...]:
        """Where every tensor a graph reads of the model lives: its weights, buffers, derived copies."""
        model = self.runner.model
        tensors = [*model.parameters(), *model.buffers(), *derived_weights.served_tensors(model)]
        # oneDNN's packed copies (a CPU where our kernels do not serve) have no storage: the copy itself names them
        return tuple(id(t) if t.is_mkldnn else t.data_ptr() for t in tensors)

    def weights_changed(self) -> None:
        """The weights were written (a push's commit, a reload): their derived copies are made now,
        and the graphs dropped if any tensor they read moved."""
        derived_weights.refresh(self.runner.model)
        if self.graphs and self._weights_read() != self.weights_read:
            log.info("the weights moved in memory: %d decode graphs dropped, captured again as steps need them",
                     len(self.graphs))
            self.graphs.clear()
        if not self.graphs:
            self.weights_read = None

