"""The trainer's bytes on the wire (weight_sync/trainer/sender.py): one broadcast per bucket from rank 0,
double buffered. A bucket made of one contiguous tensor already in the wire dtype and on the
group's device (or several laid out as the manifest lays them out: `flatten_parameters`) is
broadcast straight from the tensor's memory, zero copy; other buckets are packed into one of two
bucket buffers, packing bucket k+1 while bucket k is on the wire."""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from weight_sync.common.digest import Digest
from weight_sync.common.manifest import DTYPES, Manifest
from weight_sync.common.phases import Phases
from weight_sync.trainer.progress_marks import ProgressMarks
from weight_sync.trainer.ranks import GATHER, has_peers, tell_peers
from weight_sync.trainer.weights import full

log = logging.getLogger(__name__)


class BucketSender:
    def __init__(self, bucket_bytes: int, max_inflight: int):
        self.bucket_bytes = bucket_bytes
        self.max_inflight = max_inflight
        self.buffers: list[torch.Tensor | None] = [None, None]  # kept between pushes: packing needs no fresh pages
        self.group = None  # the group and marks of the push being sent
        self.marks: ProgressMarks | None = None
        self.gathered = 0  # sharded tensors gathered by the push being sent (see trainer_ranks)
        self.digest = Digest()  # of the bytes the push being sent put on the wire (the commit vote's)
        self.phases = Phases()  # the push being sent's: packing, hashing, waiting on the wire

    def reset(self) -> None:
        self.buffers = [None, None]

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self.buffers[slot]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, self.bucket_bytes)
            buf = torch.empty(size, dtype=torch.uint8, device=self.group.device)
            self.buffers[slot] = buf
        return buf[:nbytes]

    def _direct(self, m: Manifest, b, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """The bucket's bytes straight from the source memory, when its tensors already lie there
        as the manifest lays them out (one tensor, or several packed by `flatten_parameters`) in
        the wire dtype on the group's device: no copy."""
        live = [i for i in range(b.first, b.last) if m.tensors[i].nbytes]
        if not live:
            return None
        first = tensors[live[0]]
        if hasattr(first, "full_tensor") or first.device != self.group.device:
            return None
        storage = first.untyped_storage()
        base = first.data_ptr() - (m.tensors[live[0]].offset - b.start)  # where the bucket would start
        for i in live:
            t, spec = tensors[i], m.tensors[i]
            if (hasattr(t, "full_tensor") or t.dtype != dtype_from(spec.dtype) or not t.is_contiguous()
                    or t.untyped_storage().data_ptr() != storage.data_ptr()
                    or t.data_ptr() != base + spec.offset - b.start):
                return None
        start = base - storage.data_ptr()
        if start < 0 or start + b.nbytes > storage.nbytes():
            return None
        return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (b.nbytes,))

    def send(self, group, m: Manifest, tensors: list[torch.Tensor], progress, marks: ProgressMarks,
             phases: Phases | None = None) -> None:
        """Every bucket of `m` out (tensors in manifest order); a trainer's other ranks
        (weight_sync.trainer.ranks) take part in its gathers, and if it breaks off, this rank
        finishes the gathers so none is left waiting. `phases` counts its packing, hashing and
        waits on the wire."""
        self.group, self.marks, self.gathered, self.digest = group, marks, 0, Digest()
        self.phases = phases or Phases()
        if not has_peers():
            return self._send_buckets(m, tensors, progress)
        tell_peers(GATHER)
        try:
            self._send_buckets(m, tensors, progress)
        except BaseException:
            for t in [t for t in tensors if hasattr(t, "full_tensor")][self.gathered:]:
                t.full_tensor()
            raise

    def _pack(self, m: Manifest, b, tensors: list[torch.Tensor], out: torch.Tensor) -> None:
        for i in range(b.first, b.last):
            spec = m.tensors[i]
            src = full(tensors[i])  # every sharded tensor is gathered, in order, even an empty one
            self.gathered += hasattr(tensors[i], "full_tensor")
            if not spec.nbytes:
                continue
            lo = spec.offset - b.start
            dst = out[lo: lo + spec.nbytes].view(dtype_from(spec.dtype)).view(spec.shape)
            dst.copy_(src)

    def _send_buckets(self, m: Manifest, tensors: list[torch.Tensor], progress) -> None:
        if self.group.chain is None:
            return self._send_all(m, tensors, progress)
        done = threading.Event()
        watch = threading.Thread(target=self._watch_workers, args=(m.push_id, done), daemon=True)
        watch.start()
        try:
            self._send_all(m, tensors, progress)
        finally:
            done.set()
            watch.join()

    def _watch_workers(self, push_id: str, done: threading.Event, period_s: float = 0.5) -> None:
        """Down a chain the trainer sends only to the first worker, and gloo cannot interrupt a
        send: when a worker gives the push up (its next rank died, say), the first one stops
        reading and this send would wait for the group's timeout. A worker that gives up marks it
        in the store; seen here, the link to the first worker is closed, and the send fails now."""
        while not done.wait(period_s):
            try:
                failed = self.group.worker_failed(push_id)
            except Exception as e:  # noqa: BLE001 - a store that does not answer: the push's own waits decide
                log.warning("cannot watch push %s for workers that give up: %s", push_id, e)
                return
            if failed:
                log.warning("a worker gave push %s up: closing the chain's first link so the trainer stops sending",
                            push_id)
                self.group.cut_chain()
                return

    def _send_all(self, m: Manifest, tensors: list[torch.Tensor], progress) -> None:
        g = self.group
        inflight: deque = deque()  # (work, payload kept alive, buffer slot or None)
        slot_busy = [False, False]
        next_slot = 0
        n = len(m.buckets)
        for k, b in enumerate(m.buckets):
            if b.nbytes == 0:
                continue
            payload = self._direct(m, b, tensors)
            slot = None
            if payload is None:
                slot, next_slot = next_slot, 1 - next_slot
                while slot_busy[slot] or len(inflight) >= self.max_inflight:
                    self._retire(inflight, slot_busy)
                payload = self._buffer(slot, b.nbytes)
                # Overlaps the broadcast still in flight. On CUDA the copy runs on the current
                # stream, which ProcessGroupNCCL makes its own stream wait for.
                self.phases.timed("pack", self._pack, m, b, tensors, payload)
                slot_busy[slot] = True
            else:
                while len(inflight) >= self.max_inflight:
                    self._retire(inflight, slot_busy)
            inflight.append((g.fan_out(payload), payload, slot, k))
            self.phases.timed("hash", self._hash, m, b, payload)  # while the bucket is on the wire
            if progress is not None:
                progress(k + 1, n)
        while inflight:
            self._retire(inflight, slot_busy)
        with self.marks.on_wire():
            g.synchronize()

    def _hash(self, m: Manifest, b, payload: torch.Tensor) -> None:
        for spec in m.tensors[b.first:b.last]:
            if spec.nbytes:
                self.digest.add(payload[spec.offset - b.start:spec.offset - b.start + spec.nbytes])

    def _retire(self, inflight: deque, slot_busy: list[bool]) -> None:
        work, _, slot, k = inflight.popleft()
        with self.marks.on_wire():
            self.phases.timed("wire_wait", self.group.wait, work, f"broadcast of bucket {k}")
        self.marks.sent()
        if slot is not None:
            slot_busy[slot] = False


def dtype_from(name: str) -> torch.dtype:
    return DTYPES[name]
