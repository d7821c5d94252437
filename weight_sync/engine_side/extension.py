"""Engine side: `WeightSyncExtension`, mixed into the engine's worker through
`EngineConfig(worker_extension_cls="weight_sync.engine_side.extension:WeightSyncExtension")`. Its public methods
are reached with `collective_rpc`; arguments and results are msgpack builtins.

A thin facade, as TRL's worker extension is: each RPC delegates to the push protocol written once
in `weight_sync.engine_side.receive.PushReceiver` (check, vote, stage, commit vote, commit: all or nothing),
its overlapped variant (`weight_sync.engine_side.overlapped_receive`), and host copies
(`weight_sync.engine_side.host_copy`), over the weight target of this engine: the HF parameters of our worker
(`weight_sync.engine_side.params_target`). vLLM's workers use the same facade over vLLM's loaders
(weight_sync/vllm/extension.py).

Memory: a push holds one extra copy of the pushed weights (the staging buffer) until it commits.
With `commit="swap"` (default) the staging buffer becomes the weights and the old weights are
freed at commit; with `commit="copy"` the staging buffer is freed after the copy.
`keep_staging=True` (the default on CPU) keeps the buffer the commit freed for the next push
instead (one extra copy of the weights held for good): fresh memory costs page faults that on CPU
are slower than the network, see weight_sync/README.md. `close_weight_sync()` drops it.
"""

from __future__ import annotations

import contextlib

import torch

from engine.kernels import derived_weights
from weight_sync.common.checksum import tensor_digests, weights_checksum as _checksum
from weight_sync.common.digest import NONE
from weight_sync.engine_side.host_copy import HostCopies
from weight_sync.engine_side.overlapped_receive import OverlappedReceive
from weight_sync.engine_side.params_target import COMMIT_MODES, ParamsTarget
from weight_sync.engine_side.receive import PushReceiver
from weight_sync.engine_side.staging_memory import StagingPool


class WeightSyncExtension:
    """Worker extension (no __init__: the worker's own constructor runs). Uses the worker's
    `self.model`, `self.device`, `self.lora_bank`, `self.weights_released`."""

    # -- the parts, made at first use -------------------------------------------------------
    def _new_receiver(self) -> PushReceiver:
        # a sidecar's engine (its supervisor sweeps a dead engine's files) stages into /dev/shm files,
        # so that its host copy links the served weights instead of copying them
        cpu = self.device.type == "cpu"
        pool = StagingPool(self.device, keep=cpu, shared=cpu and self._reserves_staging())
        pool.before_reuse = self._host_copies().wait_readers
        receiver = PushReceiver(self._new_target(pool), pool, self.device, self._local_rank())
        receiver.wait_readers = self._before_in_place_write
        receiver.hold_pages = getattr(self, "pages_held", contextlib.nullcontext)  # our worker's (engine/worker.py)
        receiver.pages_first = getattr(self, "onto_huge_pages_first", receiver.pages_first)
        return receiver

    def _reserves_staging(self) -> bool:
        """Our engine's EngineConfig.reserve_push_staging (a vLLM worker has no such config)."""
        return bool(getattr(getattr(self, "cfg", None), "reserve_push_staging", False))

    def _before_in_place_write(self) -> None:
        """The served weights are about to be written where they lie: no host copy may read or
        link them meanwhile."""
        copies = self._host_copies()
        copies.wait_readers()
        copies.withdraw()

    def _new_target(self, pool: StagingPool):
        # decode graphs read the weights where they lie: a commit copies into them instead of swapping
        # (a swap would have every graph captured again; engine/decode_graphs.py)
        graphs = getattr(self.runner, "graph_mode", "off") == "capture"
        return ParamsTarget(self, pool, commit_mode="copy" if graphs else "swap")

    def _local_rank(self) -> int:
        return 0  # one worker per engine

    def _overlapped(self) -> OverlappedReceive:
        ov = self.__dict__.get("_weight_sync")
        if ov is None:
            ov = self._weight_sync = OverlappedReceive(self._new_receiver())
        return ov

    def _receiver(self) -> PushReceiver:
        return self._overlapped().receiver

    def _host_copies(self) -> HostCopies:
        copies = self.__dict__.get("_weight_copies")
        if copies is None:
            copies = self._weight_copies = HostCopies()
        return copies

    # -- RPC: group -------------------------------------------------------------------------
    def init_weight_sync(self, host: str, port: int, world_size: int, rank: int, secret: str, timeout_s: float = 60.0,
                         group_name: str = "weight-sync", keep_staging: bool | None = None,
                         commit: str | None = None) -> dict:
        """Join a fresh weight-sync group headed by the trainer (rank 0). `rank` is this engine's
        rank offset: its worker i takes rank `rank + i`; `secret` is the group's (from the
        trainer's connection info). Any previous group is closed first. Blocks until every rank
        joined or `timeout_s` passed."""
        if commit is not None and commit not in COMMIT_MODES:
            raise ValueError(f"commit must be one of {COMMIT_MODES}, got {commit!r}")
        r = self._receiver()
        self._overlapped().close(drop_staging=False)
        if keep_staging is not None:
            r.pool.set_keep(bool(keep_staging))
        if commit is not None:
            r.target.commit_mode = commit
        return r.join(host, port, world_size, rank, secret, timeout_s, group_name)

    def close_weight_sync(self, drop_staging: bool = True) -> bool:
        """Leave the group (if any); frees a kept staging buffer too unless told not to. An
        overlapped push still arriving over that group is given up: its staging memory goes now."""
        self._overlapped().close(drop_staging)
        return True

    def weight_sync_info(self) -> dict:
        r = self._receiver()
        g = r.group
        return {"group": repr(g) if g is not None else None, "group_name": g.group_name if g is not None else None,
                "ready": bool(g is not None and g.ready), "version": r.version, "last": r.last,
                "keep_staging": r.pool.keep, "commit": r.target.commit_mode,
                "spare_bytes": int(r.pool.spare.numel()) if r.pool.spare is not None else 0}

    # -- hooks the worker calls (private: not RPCs) ----------------------------------------
    def _on_worker_ready(self) -> None:
        """An engine that will take overlapped pushes (EngineConfig.reserve_push_staging: the
        sidecar's, by default) keeps its weights in a buffer laid out as a push (`adopt`: the first
        commit frees it whole for the next) and makes the first push's staging now, before it
        serves (1.2 s for 3.4 GB here), so that the first push runs as fast as the later ones; and
        the memory its derived copies go into (derived_weights.reserve_spares: the retired copies a
        commit keeps from the second push on). Memory: from the start, what any push after the first
        holds with keep_staging."""
        if self._reserves_staging() and self.device.type == "cpu":
            r = self._receiver()
            if nbytes := r.target.adopt():
                r.pool.give_back(r.pool.fresh(nbytes))
            if r.pool.keep and not self.weights_released:
                derived_weights.reserve_spares(self.model)

    def _memory_report(self) -> dict:
        """The staging buffer kept for the next push (0: none), and whether the host copy links the
        served weights (no bytes of its own) or is written (the weights' bytes again, in /dev/shm)."""
        r = self._receiver()
        spare = r.pool.spare
        return {"staging_kept": 0 if spare is None else spare.numel(),
                "host_copy_links_weights": bool(r.pool.shared)}

    def _health_problems(self) -> list[str]:
        return self._receiver().health_problems()

    def _on_weights_released(self) -> None:
        r = self._receiver()
        r.pool.drop()
        r.target.forget()
        r.pool.keep_named(None)  # no buffer of the pool's holds the weights any more
        r.digest = r.served_digest = NONE

    def _weights_reloaded(self) -> None:
        r = self._receiver()
        r.version, r.digest, r.served_digest = None, NONE, NONE  # the checkpoint's weights again, in storage of their own
        r.target.forget()
        r.pool.keep_named(None)

    # -- RPC: a trainer written for vLLM's RL routes (weight_sync/vllm/group.py) -----------------
    def join_vllm_group(self, host: str | None, port: int | None, world_size: int, rank: int,
                        timeout_s: float = 120.0, unique_id_b64: str | None = None) -> dict:
        """Join the group a vLLM trainer formed (gloo on the CPU, NCCL on CUDA) as rank `rank + i`
        for worker i; any previous such group is left."""
        from weight_sync.vllm.group import VllmTrainerGroup

        r = self._receiver()
        self.close_foreign_group()
        my_rank = int(rank) + r.local_rank
        r.foreign_group = VllmTrainerGroup(host, None if port is None else int(port), int(world_size), my_rank,
                                           float(timeout_s), r.device, unique_id_b64)
        return {"rank": my_rank, "world_size": int(world_size)}

    def join_sglang_group(self, host: str, port: int, world_size: int, rank: int, group_name: str,
                          backend: str, timeout_s: float = 120.0) -> dict:
        """Join the group a trainer written for SGLang formed (weight_sync/sglang/group.py) as rank
        `rank + i` for worker i, in the slot of a foreign trainer's group (vLLM's or SGLang's, one
        at a time): begin_receive_foreign then receives over it. Any previous such group is left."""
        from weight_sync.sglang.group import SglangTrainerGroup

        r = self._receiver()
        self.close_foreign_group()
        my_rank = int(rank) + r.local_rank
        r.foreign_group = SglangTrainerGroup(host, int(port), int(world_size), my_rank, str(group_name),
                                             str(backend), float(timeout_s), r.device)
        return {"rank": my_rank, "world_size": int(world_size)}

    def hold_staged_part(self, tied: dict[str, str] | None = None) -> dict:
        """The overlapped push just staged is a part of an update: kept, uncommitted (held_parts.py;
        `tied`: alias -> parameter, the tied weights the update names twice)."""
        return self._held_parts().hold(tied)

    def commit_held_parts(self, commit: bool = True) -> dict:
        """Every held part committed at once, between two steps (`commit=False`: dropped)."""
        held = self._held_parts()
        return held.commit() if commit else {"dropped": held.drop()}

    def drop_held_parts(self) -> int:
        return self._held_parts().drop()

    def weight_names(self) -> list[str]:
        """The names of the served weights (tied ones once), as a push names them."""
        return [n for n, _ in self._receiver().target.served()]

    def _held_parts(self):
        from weight_sync.engine_side.held_parts import HeldParts

        held = self.__dict__.get("_weight_parts")
        if held is None:
            held = self._weight_parts = HeldParts(self._overlapped())
        return held

    def begin_receive_foreign(self, manifest):
        """As begin_receive_weights, over a foreign trainer's group (vLLM's or SGLang's): answered
        once every chunk is staged (or failed); finish_staged_weights commits it."""
        return self._overlapped().begin(manifest, foreign=True)

    def close_foreign_group(self) -> bool:
        r = self._receiver()
        g, r.foreign_group = r.foreign_group, None
        self._held_parts().drop()  # an update in parts not committed: its trainer's group is gone
        staged = self._overlapped().staged
        if g is not None and staged is not None and staged.group is g and staged.arriving:
            self._overlapped()._give_up(staged)  # a transfer still arriving over it: its memory goes now
        elif g is not None:
            g.close()
        return True

    # -- RPC: checks ------------------------------------------------------------------------
    def weights_checksum(self) -> str:
        """See weight_sync.common.checksum: SHA-256 over every served weight (tied ones once) in name order."""
        return _checksum(self._receiver().target.served())

    def weight_digests(self) -> dict:
        """SHA-256 of each served weight, by name (weight_sync.common.checksum.tensor_digests)."""
        return tensor_digests(self._receiver().target.served())

    def zero_weights(self) -> bool:
        """Zero every weight (vLLM's /weight_checker "reset": a test that the next push writes them
        all). The weights are of no push now: a delta must not build on them."""
        self._before_in_place_write()
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
        self.weights_written()
        r = self._receiver()
        r.digest = r.served_digest = NONE
        return True

    def staging_room(self, nbytes: int, limit: int | None = None) -> dict:
        """Whether a staging copy of `nbytes` fits (weight_sync.engine_side.staging_memory.StagingPool.room)."""
        return self._receiver().pool.room(nbytes, limit)

    # -- RPC: pushes ------------------------------------------------------------------------
    def receive_weights(self, manifest, group_name: str | None = None) -> dict:
        """Take one push over the group (the trainer broadcasts concurrently): check -> vote ->
        receive buckets -> commit. Returns {"version", "bytes", "seconds", ...}. Raises PushRefused
        (a ValueError) if the push was refused (nothing changed, group still usable) or
        RuntimeError if it failed (nothing changed, group closed: init_weight_sync again).
        `group_name`: the trainer's group, given by a trainer that votes only once every worker
        marked itself ready (weight_sync.trainer.push); a worker in another group (or none) fails at once."""
        return self._receiver().receive(manifest, group_name)

    def receive_weights_inplace(self, manifest, group_name: str | None = None) -> dict:
        """receive_weights without a staging copy (weight_sync.engine_side.inplace_receive): a failure after
        the first write raises RuntimeError naming TORN, and the engine must be restarted."""
        return self._receiver().receive_inplace(manifest, group_name)

    def begin_receive_weights(self, manifest, group_name: str | None = None):
        """receive_weights' check, vote, buckets and commit vote, on a thread of its own: the
        engine keeps stepping with the current weights meanwhile. Answered (a Future the core
        process completes, vLLM's deferred utility answer) once the push is "staged" (every byte
        in, the commit vote passed) or "failed"; `finish_staged_weights(commit=True)` then swaps
        them in between two steps (a pointer swap: it does not grow with the model)."""
        return self._overlapped().begin(manifest, group_name)

    def staged_weights(self) -> str:
        """"none", "receiving", "staged" or "failed": where the overlapped push is, without waiting."""
        return self._overlapped().state()

    def finish_staged_weights(self, commit: bool = True) -> dict:
        """Ends an overlapped push: raises its error if it failed (a refusal as PushRefused);
        else commits it (or, `commit=False`, drops it)."""
        return self._overlapped().finish(commit)

    def receive_weights_shared(self, manifest, handle: dict) -> dict:
        """A push with no process group (weight_sync.engine_side.staging_sources): map the trainer's buffer, check it
        holds the manifest's layout, copy it into staging, commit. Raises PushRefused (nothing
        changed) for a bad manifest or a buffer that cannot be mapped."""
        from weight_sync.engine_side.local_receive import receive_shared

        return receive_shared(self._receiver(), manifest, handle)

    def load_weights_from_path(self, path: str, manifest=None) -> dict:
        """The file fallback: load a push written by `weight_sync.trainer.file_push.write_safetensors` from
        `path` (a directory, e.g. under /dev/shm). Same validation; all tensors are read into
        staging before anything is committed, so a bad or partial file changes nothing."""
        from weight_sync.engine_side.local_receive import load_from_path

        return load_from_path(self._receiver(), path, manifest)

    # -- RPC: host copies -------------------------------------------------------------------
    def save_weights(self, path: str, version: int, background: bool = False):
        """Write this worker's served weights as a push directory that another engine can
        `load_weights_from_path` (weight_sync.engine_side.host_copy); `background=True` writes from a thread
        while the engine steps, and is answered once written (a Future)."""
        r = self._receiver()
        served = getattr(r.target, "served_whole", lambda: None)()
        linked = self._host_copies().link(served, served and r.pool.file_of(served[1]), path, version,
                                          None if r.served_digest == NONE else r.served_digest)
        if linked is None:
            return self._host_copies().save(r.target.served(), path, version, background)
        return self._host_copies().saves[path] if background else linked

    def saved_weights(self, path: str) -> dict | None:
        """A background save_weights: None while it writes; its result once written; raises
        RuntimeError with its error if it failed."""
        return self._host_copies().saved(path)
