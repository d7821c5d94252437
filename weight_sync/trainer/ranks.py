"""A push from a trainer of several ranks (DDP, FSDP2 under torchrun / accelerate launch).

Rank 0 pushes (it owns the client and the weight-sync group); every other rank calls
`follow_push(model)` at the same point of its loop. Gathering a sharded parameter
(`DTensor.full_tensor()`) is a collective of the trainer's own group, so the other ranks must
take part in each gather rank 0 makes, in the same order, and only when it makes them: a push
refused before any byte moved gathers nothing, a stale layout pushes twice. So rank 0 says what
comes over the trainer's default group, one integer per pass: GATHER before each pass over the
weights (the buckets of a push attempt, or a checksum), DONE when its call is over. A pass that
fails half way (a broken transfer) still finishes its gathers on rank 0, so no rank is left
inside a collective. With one rank (or no default group) none of this runs.
"""

from __future__ import annotations

import torch

from weight_sync.trainer.weights import named_weights

GATHER, DONE = 1, 0


def has_peers() -> bool:
    """True on a trainer whose default process group has other ranks."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _flag_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tell_peers(flag: int) -> None:
    """Rank 0: announce the next pass (GATHER) or the end of the call (DONE)."""
    if not has_peers():
        return
    import torch.distributed as dist

    dist.broadcast(torch.tensor([flag], dtype=torch.int64, device=_flag_device()), src=0)


class PeersFollowing:
    """One call of rank 0 that the other ranks follow (follow_push) until it tells them DONE,
    exactly once, however many push attempts the call makes (a client that regroups and pushes
    again keeps them following across both)."""

    def __init__(self):
        self.finished = False

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            tell_peers(DONE)

    def __enter__(self) -> "PeersFollowing":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


def gather_pass(weights, skip: int = 0) -> None:
    """Take part in one pass of gathers over `weights` (every DTensor, in push order), leaving
    out the first `skip` (rank 0 finishing a pass it broke off)."""
    with named_weights(weights) as named:
        sharded = [t for _, t in named if hasattr(t, "full_tensor")]
        for t in sharded[skip:]:
            t.full_tensor()


def follow_push(weights) -> int:
    """On trainer ranks other than 0, at the point where rank 0 calls `push_weights` (or a
    checksum): take part in each of its passes until it is done. Returns the passes made."""
    if not has_peers():
        return 0
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise RuntimeError("follow_push is for the trainer's other ranks: rank 0 pushes")
    passes = 0
    while True:
        flag = torch.empty(1, dtype=torch.int64, device=_flag_device())
        dist.broadcast(flag, src=0)
        if int(flag.item()) == DONE:
            return passes
        gather_pass(weights)
        passes += 1
