"""asyncio orchestration of weight sync against AsyncEngines (anything with the AsyncEngine
methods `collective_rpc`, `reset_prefix_cache`, `set_weight_version`, `pause_generation`,
`resume_generation`). No server code: the rollout manager calls these.

The trainer's side of every step blocks (rendezvous, broadcasts), so it runs in a thread
(`asyncio.to_thread`) while the workers' RPCs are awaited concurrently.

```python
sender = WeightSender()
await init_weight_sync(engines, sender)                       # trainer = rank 0, engine i = rank 1 + i
await push_to_engines(engines, sender, model, version=1)      # validate, broadcast, commit, tag
```
Several sidecars in one group: the trainer opens one group for all (`sender.open_group(world)`),
runs `sender.join_group()` in a thread, and each sidecar calls `join_engines(its_engines, info,
rank_offset)`; a push sends the manifest to every sidecar (`receive_on_engines`) while the trainer
runs `sender.send` once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from weight_sync.manifest import Manifest
from weight_sync.sender import StaleManifestError, WeightSender, WeightSyncError

log = logging.getLogger(__name__)


def _reason(e: BaseException) -> str:
    text = str(e)
    # errors from a worker arrive as "ValueError: ..." texts already
    return text if text.startswith(("ValueError", "RuntimeError", "TimeoutError")) else f"{type(e).__name__}: {text}"


async def join_engines(engines: Sequence, info: dict, rank_offset: int = 1, timeout: float | None = None,
                       **options) -> list[dict]:
    """Have each engine's worker join the group described by `info` (from `sender.open_group`);
    engine i takes rank `rank_offset + i`. Options go to `init_weight_sync` (keep_staging, commit)."""
    kwargs = {**info, **options}
    calls = [e.collective_rpc("init_weight_sync", timeout=timeout, kwargs={**kwargs, "rank": rank_offset + i})
             for i, e in enumerate(engines)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [f"engine {i}: {_reason(r)}" for i, r in enumerate(results) if isinstance(r, BaseException)]
    if errors:
        raise WeightSyncError("joining the weight-sync group failed: " + "; ".join(errors), reasons=errors)
    return [r[0] for r in results]


async def init_weight_sync(engines: Sequence, sender: WeightSender, host: str = "127.0.0.1", port: int = 0,
                           timeout_s: float | None = None, rank_offset: int = 1, world_size: int | None = None,
                           rpc_timeout: float | None = None, **options) -> dict:
    """Form a fresh group: the trainer (rank 0) and every engine's worker. Closes any previous
    group on both sides. Returns the connection info. `world_size` defaults to
    `rank_offset + len(engines)`; pass it when other sidecars join the same group. The workers'
    RPCs wait at most `rpc_timeout` (default: the group's timeout + 30 s)."""
    world_size = world_size or rank_offset + len(engines)
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


async def receive_on_engines(engines: Sequence, manifest: Manifest | dict, timeout: float | None = None,
                             group_name: str | None = None) -> list:
    """Each engine's `receive_weights(manifest)`; one result or exception per engine. With
    `group_name`, a worker outside that group refuses at once."""
    return await asyncio.gather(*_receive_calls(engines, manifest, timeout, group_name), return_exceptions=True)


def _receive_calls(engines: Sequence, manifest: Manifest | dict, timeout: float | None,
                   group_name: str | None) -> list[asyncio.Task]:
    """The receive_weights RPCs as tasks: their requests go out at the loop's next turn."""
    wire = manifest.to_wire() if isinstance(manifest, Manifest) else manifest
    kwargs = {"group_name": group_name} if group_name is not None else None
    return [asyncio.ensure_future(e.collective_rpc("receive_weights", timeout=timeout, args=(wire,), kwargs=kwargs))
            for e in engines]


async def commit_results(engines: Sequence, results: list, version: int, what: str = "push",
                         trainer_error: BaseException | None = None) -> dict:
    """After `receive_on_engines` (results: one per engine, a list of worker results or an
    exception): reset the prefix cache and set the version on the engines that committed, then
    raise WeightSyncError with every reason if any engine (or the trainer) failed."""
    committed = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
    # Their weights did change: the cache and the version tag must follow. Both calls go out at
    # once (the core answers them in order), one round trip instead of two.
    await asyncio.gather(*(call for i in committed
                           for call in (engines[i].reset_prefix_cache(), engines[i].set_weight_version(version))))
    reasons = [f"engine {i}: {_reason(r)}" for i, r in enumerate(results) if isinstance(r, BaseException)]
    if trainer_error is not None:
        reasons.insert(0, f"trainer: {_reason(trainer_error)}")
    if reasons:
        refused = not committed and all("refused" in r for r in reasons)
        raise WeightSyncError(f"{what} of version {version} failed ({len(committed)}/{len(engines)} engines "
                              f"committed): " + " | ".join(reasons), refused=refused, reasons=reasons)
    first = results[0][0] if results and results[0] else {}
    return {"version": version, "engines": len(engines), "bytes": first.get("bytes"),
            "worker_results": [r[0] for r in results]}


async def push_to_engines(engines: Sequence, sender: WeightSender, weights, version: int,
                          timeout: float | None = None, pause_mode: str | None = None) -> dict:
    """One push: the manifest goes to every engine's worker (`receive_weights`) while the trainer
    broadcasts in a thread; then, on the engines that committed, prefix cache reset and version
    tag. Raises WeightSyncError with the trainer's and the workers' reasons on any failure
    (`.refused` is True when it was refused before any byte moved: nothing changed anywhere).

    `pause_mode` ("abort" | "wait" | "keep") pauses the engines around the push; None leaves
    pausing to the caller (the engines do not step while a push runs either way: collective_rpc
    runs on the engine's main loop). `timeout` bounds each worker RPC; every network step is also
    bounded by the group's own timeout.

    The trainer votes only once every worker marked itself ready in the group's store, so an
    engine outside the group (or gone) calls the push off at once instead of leaving the trainer
    in the vote. The trainer lists its weights while the workers check the manifest, which
    reuses the previous push's layout: weights that no longer fit it are refused by every rank
    before a byte moves, and the push runs again on a fresh layout.
    """
    if sender.group is None or not sender.group.ready:
        raise WeightSyncError("no weight-sync group: init_weight_sync(engines, sender) first", refused=True)
    workers = sender.group.world_size - 1
    if workers != len(engines):  # every rank of the group votes: they must be exactly these engines (one worker each)
        raise WeightSyncError(f"push of version {version} not started: the trainer's group has {workers} workers but "
                              f"{len(engines)} engines were given; init_weight_sync(engines, sender) with these "
                              "engines", refused=True)
    prepared = sender.prepare(weights, version, reuse_layout=True)
    try:
        if pause_mode is not None:
            await asyncio.gather(*(e.pause_generation(mode=pause_mode) for e in engines))
        t0 = asyncio.get_running_loop().time()
        results, trainer = await _push_once(engines, sender, prepared, timeout)
        if isinstance(trainer, StaleManifestError):  # nothing moved; list the weights first this time
            prepared = sender.prepare(prepared.weights, version)
            results, trainer = await _push_once(engines, sender, prepared, timeout)
        trainer_error = trainer if isinstance(trainer, BaseException) else None
        out = await commit_results(engines, results, version, "push", trainer_error)
        out["seconds"] = asyncio.get_running_loop().time() - t0
        out["trainer"] = trainer
        return out
    finally:
        if pause_mode is not None:
            await asyncio.gather(*(e.resume_generation() for e in engines), return_exceptions=True)


async def _push_once(engines: Sequence, sender: WeightSender, prepared, timeout: float | None) -> tuple[list, object]:
    """Every worker's receive_weights beside the trainer's send: (worker results, trainer result
    or error)."""
    group, push_id = sender.group, prepared.manifest.push_id
    receiving = _receive_calls(engines, prepared.manifest, timeout, group.group_name)
    await asyncio.sleep(0)  # the requests leave now, and the trainer lists its weights meanwhile (on
    sender.walk(prepared)   # this thread: a thread of its own would hold the GIL the replies need)
    state = {"gate": "waiting", "off": None}

    def call_off(i: int, task: asyncio.Task) -> None:
        # A worker that answers before voting (outside the group, no group, engine gone) would
        # leave the trainer waiting at the gate: open it with "off".
        if task.cancelled() or task.exception() is None or state["gate"] != "waiting" or state["off"]:
            return
        state["off"] = f"engine {i}: {_reason(task.exception())}"
        try:
            group.call_off(push_id)
        except Exception as e:  # the trainer then times out of the gate
            log.warning("could not call push %s off: %s", push_id, e)

    for i, task in enumerate(receiving):
        task.add_done_callback(lambda t, i=i: call_off(i, t))

    def before_vote() -> None:
        go = group.wait_ready(push_id, group.timeout_s)
        state["gate"] = "ok" if go else "off"
        if not go:
            raise WeightSyncError(f"push of version {prepared.manifest.version} called off before any byte moved: "
                                  f"{state['off']}; the trainer's group is closed, init_weight_sync again")

    trainer = (await asyncio.gather(asyncio.to_thread(sender.send, prepared, None, before_vote),
                                    return_exceptions=True))[0]
    if state["gate"] != "ok":  # workers that marked themselves ready wait in the vote: closing the group frees them
        sender.close_group()
    return await asyncio.gather(*receiving, return_exceptions=True), trainer


async def load_on_engines(engines: Sequence, path: str, version: int, manifest: Manifest | dict | None = None,
                          timeout: float | None = None) -> dict:
    """The file fallback: every engine loads the push written to `path` by
    `weight_sync.files.write_safetensors`, then prefix cache reset and version tag."""
    wire = manifest.to_wire() if isinstance(manifest, Manifest) else manifest
    calls = [e.collective_rpc("load_weights_from_path", timeout=timeout, args=(str(path), wire)) for e in engines]
    results = await asyncio.gather(*calls, return_exceptions=True)
    return await commit_results(engines, results, version, "load")



async def engines_checksums(engines: Sequence, timeout: float | None = None) -> list[str]:
    """Every worker's weights checksum, engines in order (one per worker)."""
    results = await asyncio.gather(*(e.collective_rpc("weights_checksum", timeout=timeout) for e in engines))
    return [c for r in results for c in r]


async def close_weight_sync(engines: Sequence, sender: WeightSender | None = None) -> None:
    await asyncio.gather(*(e.collective_rpc("close_weight_sync") for e in engines), return_exceptions=True)
    if sender is not None:
        sender.close_group()
