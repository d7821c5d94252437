"""The worker: owns the model runner (model + KV cache) on one device. `collective_rpc` calls
reach its RPC methods, and those of an optional extension class named in the config (as vLLM's
`worker_extension_cls`), which is how weight sync plugs in without the engine importing it."""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging

import torch

from engine.config import EngineConfig
from engine.kernels import derived_weights, huge_pages, libc
from engine.lora_bank import LoraBank
from engine.memory_report import engine_memory
from engine.models.model_loader import load_model, quantized_bytes
from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


class Worker:
    # The worker's own methods reachable through collective_rpc; anything else is refused.
    RPC_METHODS = frozenset({"model_info", "check_health", "reload_weights"})

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.runner = ModelRunner(cfg)
        self._new_lora_bank()
        self.weights_released = False
        # The version of the weights this worker serves: 0 is the checkpoint's; pushes set it.
        self.weight_version = 0
        ready = getattr(self, "_on_worker_ready", None)
        if ready is not None:  # an extension's start-up work (weight sync makes its staging ready)
            ready()
        # the weights and their copies onto 2 MB pages, on a thread of its own (engine/kernels/huge_pages.py)
        self.collapser = huge_pages.Collapser() if self.device.type == "cpu" else None
        self._onto_huge_pages()

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    # -- RPC methods ------------------------------------------------------------------------
    def model_info(self) -> dict:
        mc = self.model.config
        return {
            "model": self.cfg.model,
            "device": str(self.device),
            "dtype": self.cfg.dtype,
            "quantization": self.cfg.quantization,
            "quantized_bytes": quantized_bytes(self.model),
            "vocab_size": mc.vocab_size,
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "decode_graphs": self.runner.graph_stats(),
        }

    def check_health(self) -> dict:
        """What keeps this worker from serving, checked for real: weights present, KV cache
        allocated, a tiny forward on a fixed input giving finite logits, and the problems an
        extension reports (`_health_problems`, e.g. a weight-sync group stuck half-formed).
        Returns {"ok", "problems", "weight_version"}."""
        problems = []
        if self.weights_released:
            problems.append("weights released (sleep level 2): wake_up() first")
        if self.runner.k_cache is None:
            problems.append("KV cache not allocated (asleep): wake_up() first")
        if not self.weights_released:
            try:
                if not self.runner.probe():
                    problems.append("a forward on a fixed input gave non-finite logits")
            except Exception as e:
                problems.append(f"a forward on a fixed input failed: {type(e).__name__}: {e}")
        extra = getattr(self, "_health_problems", None)
        if extra is not None:
            problems += extra()
        return {"ok": not problems, "problems": problems, "weight_version": self.weight_version,
                "memory": self.memory()}

    def memory(self) -> dict:
        """Bytes by part (engine/memory_report.py), and an extension's parts (`_memory_report`: weight
        sync's kept staging buffer)."""
        out = engine_memory(self.model, [t for kv in self.runner.kv_caches or [] for t in kv])
        collapser = getattr(self, "collapser", None)
        out["huge_pages_moving"] = int(collapser is not None and not collapser.idle.is_set())  # 1: weights still moving
        extra = getattr(self, "_memory_report", None)
        return {**out, **(extra() if extra is not None else {})}

    def reload_weights(self) -> bool:
        """Load the weights from the model directory again (after sleep level 2, or to undo
        pushes): the checkpoint's weights, so version 0 again."""
        fresh = load_model(self.cfg, self.runner.device)
        self.runner.model = fresh
        self.runner.weights_changed()
        self._new_lora_bank()
        self.weights_released = False
        self._onto_huge_pages()
        self.weight_version = 0
        reloaded = getattr(self, "_weights_reloaded", None)
        if reloaded is not None:  # an extension that tracks pushed versions forgets them
            reloaded()
        return True

    def stage_derived_copies(self, pairs, unchanged: set | None = None) -> derived_weights.StagedCopies:
        """The copies the forward reads instead of weights (the prepacked linears), made now from
        a push's staged tensors, `pairs` of (parameter, staged tensor), while the engine serves the
        old ones; `unchanged`: ids of the parameters whose values the push keeps (a delta's). Called
        by whatever stages a push, on its own thread; its commit hands them to `weights_written`."""
        return derived_weights.stage(self.model, pairs, unchanged)

    def weights_written(self, staged: derived_weights.StagedCopies | None = None, keep_replaced: bool = False) -> None:
        """Called by whatever wrote the weights (a push's commit): the copies `staged` for them are
        served from now on. The weights a commit wrote with none staged (`staged=None`: all of them)
        have theirs dropped and derived again at the next forward: their own check (data pointer,
        version counter) misses a weight swapped back onto a buffer it used before and written
        meanwhile through another view. `keep_replaced`: the copies replaced are the next push's
        memory (a sidecar that keeps its staging between pushes: derived_weights' header)."""
        # decode graphs read the copies where they lie: the staged ones are copied into them
        derived_weights.install(self.model, staged, keep_replaced, in_place=self.runner.graph_mode != "off")
        self.runner.weights_changed()  # decode graphs: copies made now, dropped if what they read moved
        self._onto_huge_pages()
        if staged is not None and self.device.type == "cpu":
            libc.return_freed_memory()  # the replaced copies' pages, back to the OS

    def pages_held(self):
        """A context in which no weight page moves onto huge pages (a push's receive: its writes
        and merges go first; engine/kernels/huge_pages.py `Collapser.held`)."""
        return self.collapser.held() if getattr(self, "collapser", None) is not None else contextlib.nullcontext()

    def onto_huge_pages_first(self, tensors) -> None:
        """After a push's commit: `tensors` (the memory the next push writes into: its staging, the
        merges' buffers) go onto huge pages first, with the copies kept as spares, then what is served."""
        self._onto_huge_pages(first=tensors)

    def _onto_huge_pages(self, first=()) -> None:
        """Have the collapser put what the forward streams (the weights, their derived copies) on
        huge pages, after `first`; what it was doing for the weights before is dropped. Memory no
        forward reads goes first: a page collapsed under a reader stalls it (a decode step waits for
        the 2 MB move: the stream's gaps grew 40-100% for seconds after each push), and in a
        sidecar that keeps its staging the next push's weights are that memory, so from the second
        push on the served weights arrive on huge pages and their own collapse finds nothing to do."""
        if getattr(self, "collapser", None) is not None and not self.weights_released:
            self.collapser.request([*first, *derived_weights.spare_tensors(self.model), *self.model.parameters(),
                                    *derived_weights.copy_tensors(self.model)])

    def _new_lora_bank(self) -> None:
        """Unmerged LoRA versions (EngineConfig.lora_versions), hooked into the current model."""
        self.lora_bank = LoraBank(self.model, self.cfg.lora_versions) if self.cfg.lora_versions else None
        self.runner.lora_bank = self.lora_bank

    # -- sleep / wake (called by the core, not over RPC) -------------------------------------
    def sleep(self, level: int) -> None:
        self.runner.free_kv_cache()
        if level >= 2:
            # Drop the weights' storage but keep the module tree: a push or a reload refills it.
            for p in list(self.model.parameters()) + list(self.model.buffers()):
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            derived_weights.drop(self.model)
            self.weights_released = True
            if self.collapser is not None:
                self.collapser.request([])  # let go of the released weights now
            if self.lora_bank is not None:
                self.lora_bank.clear()
            released = getattr(self, "_on_weights_released", None)
            if released is not None:  # an extension's references to the weights (a LoRA base) go too
                released()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.weights_released:
            self.reload_weights()
        if self.runner.k_cache is None:
            self.runner.allocate_kv_cache()

    def rpc_allowed(self, method: str) -> bool:
        return method in self.RPC_METHODS or method in getattr(self, "EXTENSION_METHODS", ())


def _import(path: str) -> type:
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def make_worker(cfg: EngineConfig) -> Worker:
    """A Worker, with the configured extension class mixed in (its public methods become RPCs)."""
    if not cfg.worker_extension_cls:
        return Worker(cfg)
    ext = _import(cfg.worker_extension_cls)
    public = {
        name for klass in ext.__mro__ if klass is not object for name, v in vars(klass).items()
        if callable(v) and not name.startswith("_")
    }
    clash = public & set(dir(Worker))
    if clash:
        raise ValueError(f"worker extension {ext.__name__} overrides worker methods: {sorted(clash)}")
    cls = type(f"Worker+{ext.__name__}", (ext, Worker), {"EXTENSION_METHODS": frozenset(public)})
    return cls(cfg)
