"""asyncio orchestration of weight sync against AsyncEngines (anything with the AsyncEngine
methods `collective_rpc`, `reset_prefix_cache`, `set_weight_version`, `pause_generation`,
`resume_generation`): the engines' side of each step, as the process that holds them (the
sidecar, or a trainer with engines of its own: weight_sync/trainer/local_engines.py) drives it.
No server code: the rollout manager calls these.

Several sidecars in one group: the trainer opens one group for all (`sender.open_group(world)`),
runs `sender.join_group()` in a thread, and each sidecar calls `join_engines(its_engines, info,
rank_offset)`; a push sends the manifest to every sidecar (`receive_on_engines`) while the trainer
runs `sender.send` once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence

from engine.errors import error_kind
from weight_sync.common.manifest import Manifest
from weight_sync.common.votes import WeightSyncError, WeightSyncRefusedError, describe

log = logging.getLogger(__name__)


def workers_of(engine) -> int:
    """Ranks an engine holds in a weight-sync group: one per worker (vLLM's tensor-parallel ranks)."""
    return int(getattr(engine, "num_workers", 1))


def rank_offsets(engines: Sequence, rank_offset: int = 1) -> list[int]:
    """Each engine's first rank: its workers take the ranks after the engines before it."""
    return list(itertools.accumulate([rank_offset] + [workers_of(e) for e in engines[:-1]]))


async def join_engines(engines: Sequence, info: dict, rank_offset: int = 1, timeout: float | None = None,
                       **options) -> list[dict]:
    """Have each engine's workers join the group described by `info` (from `sender.open_group`);
    engine i's worker w takes rank `rank_offsets(engines, rank_offset)[i] + w`. Options go to
    `init_weight_sync` (keep_staging, commit)."""
    kwargs = {**info, **options}
    calls = [e.collective_rpc("init_weight_sync", timeout=timeout, kwargs={**kwargs, "rank": offset})
             for e, offset in zip(engines, rank_offsets(engines, rank_offset))]
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [f"engine {i}: {describe(r)}" for i, r in enumerate(results) if isinstance(r, BaseException)]
    if errors:
        raise WeightSyncError("joining the weight-sync group failed: " + "; ".join(errors), reasons=errors)
    return [r[0] for r in results]


async def receive_on_engines(engines: Sequence, manifest: Manifest | dict, timeout: float | None = None,
                             group_name: str | None = None, method: str = "receive_weights") -> list:
    """Each engine's `receive_weights(manifest)` (or `method`: receive_weights_inplace); one
    result or exception per engine. With `group_name`, each worker marks itself ready in that
    group's store (a worker outside that group fails at once)."""
    deliveries = _deliveries(engines, manifest, timeout, group_name, method)
    return await asyncio.gather(*(outcome for _, outcome in deliveries), return_exceptions=True)


async def stage_on_engines(engines: Sequence, manifest: Manifest | dict, timeout: float,
                           group_name: str | None = None, method: str = "begin_receive_weights") -> list:
    """The overlapped receive: each engine's `begin_receive_weights(manifest)` (or `method`: from a
    vLLM trainer, `begin_receive_foreign`), answered once its push is in. One result per engine:
    "staged", "failed" (finish_on_engines raises why), or the exception of a call that failed.
    The engines keep generating throughout."""
    wire = manifest.to_wire() if isinstance(manifest, Manifest) else manifest
    kwargs = {"group_name": group_name} if group_name is not None else None
    out = await asyncio.gather(*(e.collective_rpc(method, timeout=timeout, args=(wire,),
                                                  kwargs=kwargs) for e in engines), return_exceptions=True)
    return [r if isinstance(r, BaseException) else r[0] for r in out]


async def finish_on_engines(engines: Sequence, staged: list, commit: bool, timeout: float | None = None,
                            method: str = "finish_staged_weights") -> list:
    """`finish_staged_weights(commit)` (or `method(commit)`: an update held in parts,
    `commit_held_parts`) on each engine that staged or failed (its error is raised there, refusals
    as such); a call that failed before keeps its exception. One result (a list of worker results)
    or exception per engine, as `commit_results` takes them."""
    async def one(e, r):
        if isinstance(r, BaseException):
            return r
        return await e.collective_rpc(method, timeout=timeout, args=(commit,))

    return list(await asyncio.gather(*(one(e, r) for e, r in zip(engines, staged)), return_exceptions=True))


def _deliveries(engines: Sequence, manifest: Manifest | dict, timeout: float | None,
                group_name: str | None, method: str = "receive_weights") -> list[tuple[str, asyncio.Future]]:
    """The receive_weights RPCs, named "engine i", as run_push's `deliver` returns them."""
    wire = manifest.to_wire() if isinstance(manifest, Manifest) else manifest
    kwargs = {"group_name": group_name} if group_name is not None else None
    return [(f"engine {i}", asyncio.ensure_future(e.collective_rpc(method, timeout=timeout, args=(wire,),
                                                                   kwargs=kwargs)))
            for i, e in enumerate(engines)]


async def commit_results(engines: Sequence, results: list, version: int, what: str = "push",
                         trainer_error: BaseException | None = None) -> dict:
    """After the engines received (results: one per engine, a list of worker results or an
    exception): reset the prefix cache and set the version on the engines that committed, then
    raise WeightSyncError with every reason if any engine (or the trainer) failed. It is
    `refused` (nothing changed, the group still usable) when every engine refused the push
    (error kind "refused": engine.errors.RefusedError) and the trainer, if it failed, was refused too."""
    committed = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
    # Their weights did change: the version tag must follow, and the prefix cache of an engine that
    # does not key its blocks by version (ours does: the old version's KV then serves no new request).
    # The calls go out at once (the core answers them in order), one round trip.
    calls = []
    for i in committed:
        if not getattr(engines[i], "prefix_cache_keyed_by_version", False):
            calls.append(engines[i].reset_prefix_cache())
        calls.append(engines[i].set_weight_version(version))
    await asyncio.gather(*calls)
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    reasons = [f"engine {i}: {describe(r)}" for i, r in failed]
    if trainer_error is not None:
        reasons.insert(0, f"trainer: {describe(trainer_error)}")
    if reasons:
        refused = (not committed and all(error_kind(r) == "refused" for _, r in failed)
                   and (trainer_error is None or error_kind(trainer_error) == "refused"))
        kind = WeightSyncRefusedError if refused else WeightSyncError
        raise kind(f"{what} of version {version} failed ({len(committed)}/{len(engines)} engines committed): "
                   + " | ".join(reasons), reasons=reasons)
    first = results[0][0] if results and results[0] else {}
    return {"version": version, "engines": len(engines), "bytes": first.get("bytes"),
            "worker_results": [r[0] for r in results]}


async def load_on_engines(engines: Sequence, path: str, version: int, manifest: Manifest | dict | None = None,
                          timeout: float | None = None) -> dict:
    """The file fallback: every engine loads the push written to `path` by
    `weight_sync.trainer.file_push.write_safetensors`, then prefix cache reset and version tag."""
    wire = manifest.to_wire() if isinstance(manifest, Manifest) else manifest
    calls = [e.collective_rpc("load_weights_from_path", timeout=timeout, args=(str(path), wire)) for e in engines]
    results = await asyncio.gather(*calls, return_exceptions=True)
    return await commit_results(engines, results, version, "load")


async def engines_checksums(engines: Sequence, timeout: float | None = None) -> list[str]:
    """Every worker's weights checksum, engines in order (one per worker)."""
    results = await asyncio.gather(*(e.collective_rpc("weights_checksum", timeout=timeout) for e in engines))
    return [c for r in results for c in r]


async def close_weight_sync(engines: Sequence, sender=None) -> None:
    """Every engine leaves its group; `sender` (a trainer's WeightSender, when it has engines of
    its own) closes the trainer's end too."""
    await asyncio.gather(*(e.collective_rpc("close_weight_sync") for e in engines), return_exceptions=True)
    if sender is not None:
        sender.close_group()
