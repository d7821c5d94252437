"""A training run over several ranks (torchrun / accelerate launch): rank 0 owns the sidecar
client; the others get each step's rollouts from it and follow its weight pushes
(weight_sync.follow_push). Rollouts travel as msgpack bytes in a uint8 tensor over the trainer's
own process group: never pickle."""

from __future__ import annotations

import msgspec
import torch


def share(accelerator, data, kind):
    """`data` from rank 0 on every rank (decoded as `kind`); itself with one rank."""
    if accelerator.num_processes == 1:
        return data
    import torch.distributed as dist

    device = accelerator.device
    if accelerator.is_main_process:
        payload = torch.frombuffer(bytearray(msgspec.msgpack.encode(data)), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if not accelerator.is_main_process:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    if accelerator.is_main_process:
        return data
    return msgspec.msgpack.decode(payload.cpu().numpy().tobytes(), type=kind)


def my_rows(idx: torch.Tensor, accelerator) -> torch.Tensor:
    """This rank's share of a minibatch (every rank holds the whole batch; DDP averages the
    gradients of the shares)."""
    return idx[accelerator.process_index::accelerator.num_processes]


def same_permutation(n: int, seed: int, device) -> torch.Tensor:
    """A permutation every rank draws alike (from its own seeded generator, not the global one)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(device)
