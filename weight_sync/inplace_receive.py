"""The in-place receive (a mixin of `WeightSyncExtension`, weight_sync/receiver.py): a full push
written straight into the parameters, one bucket at a time, for an engine with no room for a
staging copy of its weights. The sidecar uses it only then (`staging_room` says no, or the push
needs more than `--staging-memory-limit-mb`), with the engines paused for the whole transfer.

The price of the memory saved: before the commit vote the parameters already hold part of the
new version. A transfer that fails after the first bucket landed leaves the weights torn; the
worker then reports itself unhealthy and the sidecar restarts its engine, which catches up with
the last committed weights (host copy, sibling, or the next push). A push refused at the vote
(a bad manifest) changes nothing, as always."""

from __future__ import annotations

import os
import time

import torch

from weight_sync.group import GroupError, WeightSyncGroup
from weight_sync.manifest import DTYPES, Manifest, model_params
from weight_sync.votes import commit_vote

TORN = "weights torn"  # in the error of a push that failed after writing: the sidecar restarts that engine
MARGIN = 64 << 20  # bytes left free beyond the staging copy: the allocator and the next step need some


def free_bytes(device: torch.device) -> int:
    """Memory a new buffer could take now: on CUDA the device's free memory plus what the
    caching allocator holds unused; on CPU the kernel's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class InplaceReceive:
    # -- RPC ------------------------------------------------------------------------------------
    def staging_room(self, nbytes: int, limit: int | None = None) -> dict:
        """Whether a staging copy of `nbytes` fits: a kept buffer that large, or free memory for it
        (plus a margin) within `limit`. {"fits", "free", "why"}."""
        st = self._ws()
        if st.spare is not None and st.spare.numel() >= nbytes:
            return {"fits": True, "free": None, "why": "a kept staging buffer"}
        if limit is not None and nbytes > limit:
            return {"fits": False, "free": None, "why": f"{nbytes / 2**20:.1f} MiB > the staging limit of "
                                                        f"{limit / 2**20:.1f} MiB"}
        free = free_bytes(self.device)
        if free < nbytes + MARGIN:
            return {"fits": False, "free": free, "why": f"{nbytes / 2**20:.1f} MiB needed, {free / 2**20:.1f} MiB "
                                                        f"free on {self.device}"}
        return {"fits": True, "free": free, "why": ""}

    def receive_weights_inplace(self, manifest, group_name: str | None = None) -> dict:
        """receive_weights without a staging copy: check -> vote -> each bucket into a buffer of
        one bucket, copied into its parameters -> commit vote. Raises PushRefused (nothing
        changed) for a refused push, RuntimeError naming TORN once a failure came after the
        first write (the engine must be restarted)."""
        g = self._ws_group(group_name)
        t0 = time.perf_counter()
        m, problems = self._ws_check(manifest)
        if m is not None and m.adapter is not None:
            problems = ["an in-place receive takes full pushes only (an adapter push needs little memory: send it "
                        "as usual)"]
        if group_name is not None and m is not None:
            self._ws_mark_ready(g, m.push_id)
        self._ws_vote(g, m, None, problems)
        t1 = time.perf_counter()
        written = self._ws_write_buckets(g, m)
        st = self._ws()
        st.base_id, st.w0, st.lora_spare, st.current, st.torn = None, None, None, None, False
        if getattr(self, "lora_bank", None) is not None:
            self.lora_bank.clear()
        return self._ws_done(m, t0, t1, time.perf_counter(), "broadcast, in place", written)

    # -- internals ------------------------------------------------------------------------------
    def _ws_write_buckets(self, g: WeightSyncGroup, m: Manifest) -> int:
        params, aliases = model_params(self.model)
        targets = [params[t.name] if t.name in params else params[aliases[t.name]] for t in m.tensors]
        buf = torch.empty(max((b.nbytes for b in m.buckets), default=0), dtype=torch.uint8, device=self.device)
        written = 0
        try:
            for k, b in enumerate(m.buckets):
                if b.nbytes == 0:
                    continue
                g.wait(g.broadcast(buf[:b.nbytes], src=0), f"receiving bucket {k}")
                with torch.no_grad():
                    for t, p in zip(m.tensors[b.first:b.last], targets[b.first:b.last]):
                        start = t.offset - b.start
                        p.copy_(buf[start:start + t.nbytes].view(DTYPES[t.dtype]).view(t.shape))
                written += 1
            g.synchronize()
            if not commit_vote(g):
                raise GroupError("another rank did not receive every byte")
        except Exception as e:
            self._ws_close_group(g)
            if written:
                self._ws().torn = True
                raise RuntimeError(f"in-place push of version {m.version} failed after {written} of "
                                   f"{len(m.buckets)} buckets were written: {TORN}; this engine must be restarted "
                                   f"({e})") from None
            raise RuntimeError(f"in-place push of version {m.version} failed before any byte was written, nothing "
                               f"changed: {e}. The group is closed; init_weight_sync again") from None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return written
