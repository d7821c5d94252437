"""A worker's end of the group a trainer written for vLLM's RL routes forms (issue 40): vLLM's
`stateless_init_torch_distributed_process_group(master_address, master_port, rank, world_size,
backend)`, which keys its gloo (or NCCL) group on a TCPStore at the trainer's address under the
prefix `tcp://host:port`. Joined here the same way, as rank `rank_offset + i`, with gloo bound to
this host's address on the route to the trainer (weight_sync.hosts.gloo_device, as our own groups).

The data plane is vLLM's (weight_sync/vllm_packing.py): one uint8 broadcast from rank 0 per
packed chunk, then on gloo a barrier (vLLM PR #57374, the CPU path). vLLM's trainer takes part in
no vote of ours, so the all or nothing across a sidecar's engines is the sidecar's: each engine
stages every chunk, and only when every one has does `/finish_weight_update` commit them.
"""

from __future__ import annotations

import datetime
import logging

import torch

from weight_sync.group import GroupError, _make_backend

log = logging.getLogger(__name__)


def tcp_uri(host: str, port: int) -> str:
    """vLLM's `get_tcp_uri`: the store prefix of its stateless groups."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class VllmTrainerGroup:
    def __init__(self, host: str, port: int, world_size: int, rank: int, timeout_s: float = 120.0):
        from torch.distributed import PrefixStore, TCPStore

        self.host, self.port, self.world_size, self.rank, self.timeout_s = host, port, world_size, rank, timeout_s
        self.group_name = f"vllm:{tcp_uri(host, port)}"
        td = datetime.timedelta(seconds=timeout_s)
        try:
            self.store = TCPStore(host, port, world_size, False, td)
            self.backend = _make_backend("gloo", PrefixStore(tcp_uri(host, port), self.store), rank, world_size,
                                         timeout_s, host)
        except Exception as e:
            raise GroupError(f"could not join the trainer's group at {tcp_uri(host, port)} as rank {rank} of "
                             f"{world_size}: {e}") from e
        self.ready = True

    def receive(self, chunk: torch.Tensor, what: str) -> None:
        """One packed chunk from rank 0 into `chunk`, then the barrier that follows it."""
        from torch.distributed import BarrierOptions, BroadcastOptions

        td = datetime.timedelta(seconds=self.timeout_s)
        opts = BroadcastOptions()
        opts.rootRank = 0
        try:
            self.backend.broadcast([chunk], opts).wait(td)
            self.backend.barrier(BarrierOptions()).wait(td)
        except Exception as e:
            self.ready = False
            raise GroupError(f"{what} failed on rank {self.rank}: {e}") from e

    def abort(self) -> None:
        self.ready = False

    def close(self) -> None:
        self.ready = False
        self.backend = None
        self.store = None

    def __repr__(self) -> str:
        return f"VllmTrainerGroup({tcp_uri(self.host, self.port)}, rank {self.rank}/{self.world_size})"
