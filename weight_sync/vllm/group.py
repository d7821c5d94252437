"""A worker's end of the group a trainer written for vLLM's RL routes forms (issue 40): vLLM's
`stateless_init_torch_distributed_process_group(master_address, master_port, rank, world_size,
backend)`, which keys its gloo (or NCCL) group on a TCPStore at the trainer's address under the
prefix `tcp://host:port`. Joined here the same way, as rank `rank_offset + i`, with gloo bound to
this host's address on the route to the trainer (weight_sync.common.hosts.gloo_device, as our own groups).

On CUDA the group is vLLM's own: `StatelessProcessGroup` on that TCPStore (no prefix) carries
rank 0's NCCL unique id (read by weight_sync/vllm/nccl_unique_id.py, which unpickles that one value and
nothing else), or the trainer sends the id itself (`nccl_unique_id_b64`, no store); the workers
then join NCCL on it (weight_sync/vllm/nccl_comm.py) and answer vLLM's one-element warm-up all-reduce.

The data plane is vLLM's (weight_sync/vllm/packing.py): one uint8 broadcast from rank 0 per
packed chunk, then on gloo a barrier (vLLM PR #57374, the CPU path); on NCCL nothing more. vLLM's
trainer takes part in no vote of ours, so the all or nothing across a sidecar's engines is the
sidecar's: each engine stages every chunk, and only when every one has does
`/finish_weight_update` commit them.
"""

from __future__ import annotations

import datetime
import logging

import torch

from weight_sync.common.group import GroupError, _make_backend

log = logging.getLogger(__name__)


def tcp_uri(host: str, port: int) -> str:
    """vLLM's `get_tcp_uri`: the store prefix of its stateless groups."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class VllmTrainerGroup:
    """`host`/`port`: the trainer's TCPStore; or, on CUDA, `unique_id_b64` (the trainer's NCCL id,
    no store). `device`: where the worker receives (cuda: NCCL; else gloo)."""

    def __init__(self, host: str | None, port: int | None, world_size: int, rank: int, timeout_s: float = 120.0,
                 device: str | torch.device = "cpu", unique_id_b64: str | None = None):
        self.host, self.port, self.world_size, self.rank, self.timeout_s = host, port, world_size, rank, timeout_s
        self.device = torch.device(device)
        self.where = "an NCCL unique id" if unique_id_b64 else tcp_uri(host, port)
        self.group_name = f"vllm:{self.where}"
        self.store = self.backend = self.nccl = None
        if self.device.type != "cuda" and unique_id_b64:
            raise GroupError(f"init_info.nccl_unique_id_b64: an NCCL group needs workers on CUDA; this one's are on "
                             f"{self.device}: give master_address and master_port (a gloo group)")
        try:
            if self.device.type == "cuda":
                self._join_nccl(unique_id_b64)
            else:
                self._join_gloo()
        except Exception as e:
            raise GroupError(f"could not join the trainer's group at {self.where} as rank {rank} of "
                             f"{world_size}: {e}") from e
        self.ready = True

    def _store(self):
        from torch.distributed import TCPStore

        return TCPStore(self.host, self.port, self.world_size, False, datetime.timedelta(seconds=self.timeout_s))

    def _join_gloo(self) -> None:
        from torch.distributed import PrefixStore

        self.store = self._store()
        self.backend = _make_backend("gloo", PrefixStore(tcp_uri(self.host, self.port), self.store), self.rank,
                                     self.world_size, self.timeout_s, self.host)

    def _join_nccl(self, unique_id_b64: str | None) -> None:
        from weight_sync.vllm import nccl_unique_id
        from weight_sync.vllm.nccl_comm import NcclComm

        if unique_id_b64:
            uid = nccl_unique_id.from_b64(unique_id_b64)
        else:
            self.store = self._store()
            uid = nccl_unique_id.read_from_store(self.store)
        self.nccl = NcclComm(uid, self.rank, self.world_size, self.device, self.timeout_s)
        self.nccl.all_reduce(torch.zeros(1, device=self.device))  # PyNcclCommunicator's warm-up, on every rank
        self.nccl.wait("the NCCL warm-up all-reduce")

    def receive(self, chunk: torch.Tensor, what: str) -> None:
        """One packed chunk from rank 0 into `chunk` (then, on gloo, the barrier that follows it)."""
        try:
            if self.nccl is not None:
                self.nccl.broadcast(chunk)
                self.nccl.wait(what)
                return
            from torch.distributed import BarrierOptions, BroadcastOptions

            td = datetime.timedelta(seconds=self.timeout_s)
            opts = BroadcastOptions()
            opts.rootRank, opts.timeout = 0, td  # the backend's default bounds only its rendezvous
            barrier = BarrierOptions()
            barrier.timeout = td
            self.backend.broadcast([chunk], opts).wait(td)
            self.backend.barrier(barrier).wait(td)
        except Exception as e:
            self.ready = False
            raise GroupError(f"{what} failed on rank {self.rank}: {e}") from e

    def abort(self) -> None:
        """From another thread: NCCL's waits fail now; gloo's end at their timeout (they cannot be stopped)."""
        self.ready = False
        if self.nccl is not None:
            self.nccl.abort()

    def close(self) -> None:
        self.abort()
        self.backend = self.store = None

    def __repr__(self) -> str:
        return f"VllmTrainerGroup({self.where}, rank {self.rank}/{self.world_size}, {self.device})"
