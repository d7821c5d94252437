"""Our weight receiver inside vLLM's workers: `VllmWeightSyncExtension`, vLLM's
`worker_extension_cls` for `rollout.serve --engine vllm` (engine/vllm_start.py passes it).

The protocol is ours unchanged (weight_sync/receiver.py: manifest vote, staging, commit vote, all or
nothing; the overlapped receive, the shared-memory and file transports). What differs is where the
weights go:

- vLLM's parameters are not the trainer's (q/k/v and gate/up fused, tensor-parallel shards, and on
  CPU linear weights repacked for oneDNN with the originals freed), so a manifest is checked against
  the checkpoint's own HF names, shapes and dtypes (weight_sync/checkpoint_params.py);
- the commit hands the staged tensors to vLLM's own loaders, `model_runner.reload_weights(
  weights_iterator=..., is_checkpoint_format=True)`: each tensor-parallel rank receives every
  tensor and its loaders keep its shard, then repack;
- what was committed stays readable, for checksums and for copies to a restarted engine: the
  staging buffer itself (on CPU the buffer exists anyway; on CUDA it is copied to host memory).

vLLM's errors cross its process boundary as text only, so every call here names its exception's
class in the message ("PushRefused: ..."); engine/vllm_engine.py turns refusals back into
ValueErrors, which the sidecar reads as "nothing changed".
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from weight_sync.checkpoint_params import checkpoint_params, load_checkpoint
from weight_sync.inplace_receive import TORN
from weight_sync.manifest import DTYPES, Manifest, validate_manifest
from weight_sync.receiver import WeightSyncExtension
from weight_sync.staging_memory import whole
from weight_sync.votes import commit_vote

log = logging.getLogger(__name__)

NOT_KEPT = object()  # the committed weights after an in-place push: vLLM's repacked tensors alone hold them
VLLM_EXTENSION = "weight_sync.vllm_receiver.VllmWeightSyncExtension"  # vLLM takes dotted names


class _VllmSyncExtension(WeightSyncExtension):
    """The receiver with vLLM's worker as its host (`self.model_runner`, `self.vllm_config`,
    `self.rank`, `self.device`)."""

    def _ws_local_rank(self) -> int:
        return int(self.rank)  # this worker's rank in its engine (tensor parallel)

    # -- what a push must look like: the checkpoint's tensors -----------------------------------
    def _vllm_serving_dtype(self) -> torch.dtype:
        return self.vllm_config.model_config.dtype

    def _vllm_checkpoint(self) -> tuple[dict, dict]:
        cached = getattr(self, "_vllm_ckpt", None)
        if cached is None:
            cached = self._vllm_ckpt = checkpoint_params(self.vllm_config.model_config.model,
                                                         self._vllm_serving_dtype())
        return cached

    def _ws_check(self, manifest) -> tuple[Manifest | None, list[str]]:
        try:
            m = Manifest.from_wire(manifest)
        except Exception as e:
            return None, [f"malformed manifest: {e}"]
        if m.adapter is not None:
            return m, ["adapter pushes into vLLM are not supported: push the merged weights "
                       "(push_weights(model, mode='merged'))"]
        if getattr(self.vllm_config, "lora_config", None) is not None:
            return m, ["this vLLM engine serves LoRA adapters: full pushes into it are not supported"]
        try:
            params, aliases = self._vllm_checkpoint()
        except Exception as e:
            return m, [f"cannot read the checkpoint's tensors to check the push against: {e}"]
        return m, validate_manifest(m, params, aliases)

    # -- the commit: vLLM's loaders --------------------------------------------------------------
    def _ws_plan_commit(self, m: Manifest, staging: torch.Tensor) -> dict:
        _, aliases = self._vllm_checkpoint()
        pairs = [(aliases.get(t.name, t.name), staging[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape))
                 for t in m.tensors]
        return {"pairs": pairs}

    def _ws_commit(self, m: Manifest, staging: torch.Tensor, plan: dict | None = None) -> None:
        """vLLM's reload from the staged tensors. Its reload drops each layer's old tensors before
        loading the new ones, so a failure inside it (none is expected: names, shapes and dtypes
        were checked) leaves the engine torn: it then reports itself unhealthy and is restarted."""
        st = self._ws()
        pairs = (plan or self._ws_plan_commit(m, staging))["pairs"]
        try:
            with _quiet_reload():
                self.model_runner.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
        except Exception as e:
            st.torn = True
            raise RuntimeError(f"vLLM's reload of version {m.version} failed half way: {TORN}; "
                               f"this engine must be restarted ({type(e).__name__}: {e})") from None
        self._vllm_retie_head()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._vllm_keep_committed(m, staging, pairs)

    def _vllm_retie_head(self) -> None:
        """A tied output head is not among the checkpoint's tensors, so vLLM's reload puts its old
        kernel tensors back; on CPU that is a oneDNN-packed copy of the old embedding, and the logits
        would come from the old weights. Point it at the new embedding and pack it again."""
        if not self._vllm_checkpoint()[1]:
            return
        model = self.model_runner.get_model()
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or not hasattr(head, "quant_method"):
            return
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)

    def _vllm_keep_committed(self, m: Manifest, staging: torch.Tensor, pairs: list) -> None:
        """The committed tensors stay readable; the buffer they replace becomes the spare."""
        st = self._ws()
        previous = getattr(self, "_vllm_committed", None)
        previous = previous if isinstance(previous, list) and previous else None
        if self.device.type != "cpu":  # device memory is the scarce kind: keep the copy on the host
            host = whole(staging).to("cpu")
            pairs = [(n, host[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape))
                     for (n, _), t in zip(pairs, m.tensors)]
            self._ws_release(staging)
        self._vllm_committed = pairs
        if previous and st.keep_staging and st.spare is None and previous[0][1].device == staging.device:
            st.spare = whole(previous[0][1])

    def _served_weights(self):
        committed = getattr(self, "_vllm_committed", None)
        if committed is NOT_KEPT:
            raise RuntimeError("the weights came by an in-place push, which keeps no copy of them: no checksum or "
                               "copy of this engine's weights until the next staged push")
        if committed is not None:
            dtype = self._vllm_serving_dtype()
            return [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in committed]
        return list(load_checkpoint(self.vllm_config.model_config.model, self._vllm_serving_dtype()))

    def save_weights(self, path: str, version: int, background: bool = False) -> dict:
        """Rank 0 writes the engine's weights (every rank holds them whole); other ranks write nothing."""
        if self.rank != 0:
            return {"path": path, "bytes": 0, "seconds": 0.0}
        return super().save_weights(path, version, background)

    def saved_weights(self, path: str) -> dict | None:
        if self.rank != 0:
            return {"path": path, "bytes": 0, "seconds": 0.0}
        return super().saved_weights(path)

    # -- the in-place receive: streamed into vLLM's loaders --------------------------------------
    def _ws_write_buckets(self, g, m: Manifest) -> int:
        """Each bucket is received into a buffer of its own and handed to vLLM's loaders as it
        arrives (they hold a layer's tensors until the layer is whole, then process and drop
        them): memory of a few buckets, no staging copy. The commit vote comes after the last
        bucket; a failure after the first leaves the weights torn."""
        from weight_sync.group import GroupError

        _, aliases = self._vllm_checkpoint()
        state = {"written": 0}

        def arriving():
            for k, b in enumerate(m.buckets):
                if b.nbytes == 0:
                    continue
                buf = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
                g.wait(g.broadcast(buf, src=0), f"receiving bucket {k}")
                state["written"] += 1
                for t in m.tensors[b.first:b.last]:
                    start = t.offset - b.start
                    yield aliases.get(t.name, t.name), buf[start:start + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)
            g.synchronize()
            if not commit_vote(g):
                raise GroupError("another rank did not receive every byte")

        try:
            with _quiet_reload():
                self.model_runner.reload_weights(weights_iterator=arriving(), is_checkpoint_format=True)
        except Exception as e:
            self._ws_close_group(g)
            self._ws().torn = True  # vLLM's reload dropped the old tensors as it began
            raise RuntimeError(f"in-place push of version {m.version} failed after {state['written']} of "
                               f"{len(m.buckets)} buckets: {TORN}; this engine must be restarted ({e})") from None
        self._vllm_retie_head()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._vllm_committed = NOT_KEPT
        return state["written"]


@contextlib.contextmanager
def _quiet_reload():
    """vLLM's reload warns "Failed to load weights" for every layer with nothing in a checkpoint
    (rotary caches, a tied head: _vllm_retie_head) at every push: expected here, so not logged."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = layerwise.level
    layerwise.setLevel(logging.ERROR)
    try:
        yield
    finally:
        layerwise.setLevel(level)


def _named_errors(fn):
    """vLLM passes a worker's exception on as its message alone: put the class name in it."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:
            raise type(e)(f"{type(e).__name__}: {e}") if _rebuildable(e) else RuntimeError(
                f"{type(e).__name__}: {e}") from None
    return call


def _rebuildable(e: Exception) -> bool:
    try:
        type(e)("x")
        return True
    except Exception:
        return False


def _public_rpcs(cls) -> dict:
    return {name: _named_errors(getattr(cls, name)) for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))}


VllmWeightSyncExtension = type("VllmWeightSyncExtension", (_VllmSyncExtension,), {
    **_public_rpcs(_VllmSyncExtension), "__module__": __name__,
    "__doc__": "vLLM's worker_extension_cls: the receiver's RPCs, each error named by its class."})
