"""A worker's end of the group a trainer written for SGLang forms (issue 51). SGLang's workers join
with `init_custom_process_group(backend, init_method=f"tcp://{master_address}:{master_port}",
world_size, rank=rank_offset + tp_rank, group_name)` (python/sglang/srt/utils, a copy of torch's
`init_process_group` that slime and AReaL copy again for the trainer's end): torch's rendezvous (a
TCPStore the trainer, rank 0, hosts) under `PrefixStore(group_name)`, then torch's group helper adds
`f"{group_name}/"` and the device (`cpu/` for gloo, `cuda/` for NCCL) before the backend's own keys.
Joined here with the same stores and a raw backend, registered nowhere (as our own groups,
weight_sync/common/group.py), so leaving it needs no global state.

The data plane is SGLang's: one broadcast from rank 0 per tensor (`update_weights_from_distributed`),
or one uint8 broadcast of a flattened bucket (`load_format="flattened_bucket"`); no barrier, no vote.
"""

from __future__ import annotations

import datetime
import logging

import torch

from weight_sync.common.group import GroupError, _make_backend

log = logging.getLogger(__name__)

BACKENDS = {"gloo": "cpu", "nccl": "cuda"}  # SGLang's backend names, and the device each moves tensors on


class SglangTrainerGroup:
    """`host`/`port`: the trainer's TCPStore; `backend`: "gloo" (CPU workers) or "nccl" (CUDA)."""

    def __init__(self, host: str, port: int, world_size: int, rank: int, group_name: str, backend: str,
                 timeout_s: float = 120.0, device: str | torch.device = "cpu"):
        self.host, self.port, self.world_size, self.rank = host, int(port), int(world_size), int(rank)
        self.group_name, self.backend_name, self.timeout_s = f"sglang:{group_name}", backend, float(timeout_s)
        self.device = torch.device(device)
        if BACKENDS.get(backend) != self.device.type:
            raise GroupError(f"backend {backend!r} cannot move tensors on {self.device}: use "
                             f"{'nccl' if self.device.type == 'cuda' else 'gloo'}")
        try:
            self._join(group_name)
        except Exception as e:
            raise GroupError(f"could not join the trainer's group {group_name} at {host}:{port} as rank {rank} of "
                             f"{world_size}: {e}") from e
        self.ready = True

    def _join(self, group_name: str) -> None:
        from torch.distributed import PrefixStore, TCPStore

        td = datetime.timedelta(seconds=self.timeout_s)
        self.store = TCPStore(self.host, self.port, self.world_size, False, td)
        store = PrefixStore(f"{BACKENDS[self.backend_name]}/",
                            PrefixStore(f"{group_name}/", PrefixStore(group_name, self.store)))
        self.backend = _make_backend(self.backend_name, store, self.rank, self.world_size, self.timeout_s, self.host)

    def receive(self, chunk: torch.Tensor, what: str) -> None:
        """One broadcast from rank 0 into `chunk` (a tensor's bytes, or a flattened bucket)."""
        from torch.distributed import BroadcastOptions

        try:
            opts = BroadcastOptions()
            opts.rootRank, opts.timeout = 0, datetime.timedelta(seconds=self.timeout_s)
            self.backend.broadcast([chunk], opts).wait(opts.timeout)
        except Exception as e:
            self.ready = False
            raise GroupError(f"{what} failed on rank {self.rank}: {e}") from e

    def abort(self) -> None:
        """From another thread: NCCL's waits fail now; gloo's end at their timeout (they cannot be stopped)."""
        self.ready = False
        if self.backend_name == "nccl" and self.backend is not None:
            try:
                self.backend.abort()
            except Exception:  # noqa: BLE001 - aborting a broken communicator
                pass

    def close(self) -> None:
        self.abort()
        self.backend = self.store = None

    def __repr__(self) -> str:
        return f"SglangTrainerGroup({self.group_name} at {self.host}:{self.port}, rank {self.rank}/{self.world_size})"
