"""A push from memory the trainer shares with the sidecars on its machine (weight_sync.trainer.shared_memory): no
group and no init_weight_sync; colocated on one GPU, this is the way (CUDA IPC). The engines read
the trainer's own buffer, so the call returns only once they have."""

from __future__ import annotations

import asyncio

from rollout.common import protocol as P
from rollout.client.push_call import PushCall
from rollout.client.push_links import PushLinks
from rollout.client.sidecar_link import ACTIVE, JOINING, SidecarError


async def push_shared(sender, links: PushLinks, weights, push: PushCall) -> tuple[list[int], list]:
    """Every active or joining sidecar reads `weights` (a `flatten_parameters(model, shared=True)`
    model's) from shared memory: (those sidecars, their replies), or SidecarError with every reason."""
    from weight_sync.trainer.ranks import DONE, tell_peers
    from weight_sync.trainer.shared_memory import export_weights
    from weight_sync.trainer.weights import named_weights

    try:
        prepared = sender.prepare(weights, push.version)
        with named_weights(prepared.weights) as named:
            shared = export_weights(prepared.manifest, named)
    finally:
        tell_peers(DONE)  # nothing to gather from shared memory: a trainer's other ranks stop following
    members = links.members(ACTIVE, JOINING)
    replies = await asyncio.gather(*(links.call(i, P.PushWeights, "push_weights", push.timeout_s + 60,
                                                manifest=prepared.manifest, pause_mode=push.pause_mode or "",
                                                timeout_s=push.timeout_s, shared=shared) for i in members),
                                   return_exceptions=True)
    push.mark_sent()  # only now: the engines read the trainer's own buffer, which its next step changes
    errors = [str(r) for r in replies if isinstance(r, BaseException)]
    if errors:
        raise SidecarError(f"push of version {push.version} failed: " + " | ".join(errors))
    return members, replies
