"""A trainer with engines of its own process (tests, benchmarks, a one-process set-up): the
trainer's side of each step runs in a thread (`asyncio.to_thread`: rendezvous and broadcasts
block) while the engines' RPCs (weight_sync/engine_side/engines.py) are awaited concurrently. A
push's steps are `weight_sync.trainer.push`; this module only delivers them to local engines.

```python
sender = WeightSender()
await init_weight_sync(engines, sender)                       # trainer = rank 0, then each engine's workers
await push_to_engines(engines, sender, model, version=1)      # validate, broadcast, commit, tag
```
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from weight_sync.common.votes import WeightSyncError, WeightSyncRefusedError
from weight_sync.engine_side.engines import _deliveries, commit_results, join_engines, workers_of

if TYPE_CHECKING:  # the sender imports torch; this module is imported before a push runs
    from weight_sync.trainer.sender import WeightSender


async def init_weight_sync(engines: Sequence, sender: WeightSender, host: str = "127.0.0.1", port: int = 0,
                           timeout_s: float | None = None, rank_offset: int = 1, world_size: int | None = None,
                           rpc_timeout: float | None = None, **options) -> dict:
    """Form a fresh group: the trainer (rank 0) and every engine's worker. Closes any previous
    group on both sides. Returns the connection info. `world_size` defaults to `rank_offset` +
    the engines' workers; pass it when other sidecars join the same group. The workers' RPCs
    wait at most `rpc_timeout` (default: the group's timeout + 30 s)."""
    world_size = world_size or rank_offset + sum(workers_of(e) for e in engines)
    info = sender.open_group(world_size, host=host, port=port, timeout_s=timeout_s)
    join = asyncio.ensure_future(asyncio.to_thread(sender.join_group))
    try:
        await join_engines(engines, info, rank_offset, timeout=rpc_timeout or info["timeout_s"] + 30, **options)
    except BaseException:
        sender.close_group()
        await asyncio.gather(join, return_exceptions=True)
        raise
    await join
    return info


async def push_to_engines(engines: Sequence, sender: WeightSender, weights, version: int,
                          timeout: float | None = None, pause_mode: str | None = None, mode: str = "adapter",
                          delta: bool | None = False, anchor: bool = False) -> dict:
    """One push (weight_sync.trainer.push.run_push; `delta` and `anchor` as there) delivered as
    every engine's `receive_weights`; then, on the engines that committed, prefix cache reset and
    version tag. Raises WeightSyncError
    with the trainer's and the workers' reasons on any failure (`.refused` is True when it was
    refused before any byte moved: nothing changed anywhere).

    `pause_mode` ("abort" | "wait" | "keep") pauses the engines around the push; None leaves
    pausing to the caller (the engines do not step while a push runs either way: collective_rpc
    runs on the engine's main loop). `timeout` bounds each worker RPC and the wait for the
    workers to be ready; every network step is also bounded by the group's own timeout."""
    if sender.group is None or not sender.group.ready:
        raise WeightSyncRefusedError("no weight-sync group: init_weight_sync(engines, sender) first")
    workers = sender.group.world_size - 1
    if workers != sum(workers_of(e) for e in engines):  # every rank votes: exactly these engines' workers
        raise WeightSyncRefusedError(f"push of version {version} not started: the trainer's group has {workers} workers but "
                              f"the {len(engines)} engines given have {sum(workers_of(e) for e in engines)}; "
                              "init_weight_sync(engines, sender) with these engines")
    from weight_sync.trainer.push import run_push

    group_name = sender.group.group_name
    try:
        if pause_mode is not None:
            await asyncio.gather(*(e.pause_generation(mode=pause_mode) for e in engines))
        t0 = asyncio.get_running_loop().time()
        outcome = await run_push(sender, weights, version, lambda m: _deliveries(engines, m, timeout, group_name),
                                 timeout, mode=mode, delta=delta, anchor=anchor)
        trainer_error = outcome.trainer if isinstance(outcome.trainer, BaseException) else None
        out = await commit_results(engines, outcome.results, version, "push", trainer_error)
        out["seconds"] = asyncio.get_running_loop().time() - t0
        out["trainer"] = outcome.trainer
        return out
    finally:
        if pause_mode is not None:
            await asyncio.gather(*(e.resume_generation() for e in engines), return_exceptions=True)


async def push_shared_to_engines(engines: Sequence, sender: WeightSender, weights, version: int,
                                 timeout: float | None = None, pause_mode: str | None = None) -> dict:
    """A push with no process group, to engines on this machine (weight_sync.trainer.shared_memory):
    each reads the trainer's buffer (`flatten_parameters(model, shared=True)`) and commits. The
    sender only builds the manifest; it needs no group. A PEFT model goes merged
    (weight_sync.trainer.lora_push)."""
    from weight_sync.trainer.lora_push import push_source
    from weight_sync.trainer.ranks import DONE, tell_peers
    from weight_sync.trainer.shared_memory import export_weights
    from weight_sync.trainer.weights import named_weights

    try:
        prepared = sender.prepare(push_source(weights, "merged"), version)
        with named_weights(prepared.weights) as named:
            handle = export_weights(prepared.manifest, named)
    finally:
        tell_peers(DONE)  # nothing to gather from shared memory: a trainer's other ranks stop following
    wire = prepared.manifest.to_wire()
    try:
        if pause_mode is not None:
            await asyncio.gather(*(e.pause_generation(mode=pause_mode) for e in engines))
        calls = [e.collective_rpc("receive_weights_shared", timeout=timeout, args=(wire, handle)) for e in engines]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return await commit_results(engines, results, version, "shared-memory push")
    finally:
        if pause_mode is not None:
            await asyncio.gather(*(e.resume_generation() for e in engines), return_exceptions=True)
