"""vLLM's RL routes on the sidecar's HTTP front (`rollout.serve --http-port P --weight-transfer-routes`):
the paths, bodies and answers of vLLM's `vllm/entrypoints/rl/online/api_router.py`, so that
`HTTPVLLMWeightSyncClient` and trainers built on it drive the sidecar unchanged. What each does is
rollout/sidecar/vllm_transfer.py's (over the sidecar's one staged push, rollout/sidecar/push_coordinator.py). Off
unless asked for (they change the model, as vLLM keeps them behind VLLM_SERVER_DEV_MODE); the
front's token rule holds for them: a sidecar with --token needs `Authorization: Bearer <token>` on
these routes too."""

from __future__ import annotations

import asyncio

from fastapi import Body, FastAPI, HTTPException, Query

from rollout.sidecar.foreign_group import TransferError
from rollout.sidecar.vllm_transfer import VllmTransfer


async def run(coro):
    """A transfer call; its refusal as the HTTP status it names."""
    try:
        return await coro
    except TransferError as e:
        raise HTTPException(e.status, detail={"message": str(e)}) from None


def add_rl_routes(app: FastAPI, transfer: VllmTransfer) -> None:
    _add_group_routes(app, transfer)
    _add_update_routes(app, transfer)
    _add_checker_route(app, transfer)
    _add_state_routes(app, transfer)
    _add_pause_routes(app, transfer)


def _add_group_routes(app: FastAPI, transfer: VllmTransfer) -> None:
    """The trainer's group: joined, and left."""

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(init_info: dict = Body(embed=True)):
        await run(transfer.init(init_info))
        return {"message": "Weight transfer initialized"}

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine():
        await run(transfer.shutdown())
        return {"message": "Weight transfer shut down"}


def _add_update_routes(app: FastAPI, transfer: VllmTransfer) -> None:
    """The weight update: start, update and finish, and the version it is named by."""

    @app.post("/start_weight_update")
    async def start_weight_update():
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(update_info: dict = Body(embed=True)):
        out = await run(transfer.update(update_info))
        return {"message": "Weights updated", **out}

    @app.post("/start_draft_weight_update")
    async def start_draft_weight_update():
        raise HTTPException(400, detail={"message": "this sidecar serves no draft model (speculative decoding)"})

    @app.post("/finish_weight_update")
    async def finish_weight_update(weight_version: str | None = Body(None, embed=True)):
        version = await run(transfer.finish(weight_version))
        return {"message": "Weight update finished", "weight_version": str(version)}

    @app.post("/update_weight_version")
    async def update_weight_version(new_version: str = Body(embed=True)):
        await run(transfer.relabel(new_version))
        return {"success": True, "new_version": new_version}


def _add_checker_route(app: FastAPI, transfer: VllmTransfer) -> None:
    @app.post("/weight_checker")
    async def weight_checker(action: str = Body(embed=True), baseline: dict | None = Body(None, embed=True)):
        """vLLM's: "checksum" (SHA-256 per weight), "compare" (against a baseline of those), or
        "reset" (zero the weights, so that a later compare shows the next push wrote them all)."""
        if action not in ("checksum", "reset", "compare"):
            raise HTTPException(400, detail={"message": f"action: {action!r} is not checksum, reset or compare",
                                             "param": "action"})
        if action == "compare" and not isinstance(baseline, dict):
            raise HTTPException(400, detail={"message": "action 'compare' needs a 'baseline' object",
                                             "param": "baseline"})
        if action == "reset":
            await run(transfer.zero())
            return {"status": "reset"}
        checksums = await run(transfer.checksums())
        if action == "checksum":
            return {"checksums": checksums}
        mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
        return {"match": not mismatches, "mismatches": mismatches}


def _add_state_routes(app: FastAPI, transfer: VllmTransfer) -> None:
    """What the trainer asks of the sidecar's state."""
    manager = transfer.manager

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": str(manager.version)}

    @app.get("/get_world_size")
    async def get_world_size():
        return {"world_size": transfer.world_size()}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": transfer.paused_mode is not None}

    @app.get("/server_info")
    async def server_info(config_format: str = Query("text")):
        """What TRL reads of vLLM's: the weight-transfer backend, the model's dtype (the weights'
        wire dtype) and logprobs mode; the rest of vLLM's config does not exist here."""
        if config_format not in ("text", "json"):
            raise HTTPException(400, detail={"message": f"config_format: {config_format!r} is not 'text' or 'json'",
                                             "param": "config_format"})
        engines = manager.up_engines() or manager.engines
        config = {"weight_transfer_config": {"backend": "nccl"},  # vLLM's name for the packed broadcast
                  "model_config": {"dtype": engines[0].cfg.dtype, "max_model_len": manager.max_model_len,
                                   "logprobs_mode": f"{engines[0].cfg.logprobs_mode}_logprobs",
                                   **manager.serving()},
                  "parallel_config": {"world_size": transfer.world_size()}}
        return {"vllm_config": config if config_format == "json" else str(config), "vllm_env": {}, "system_env": {}}


def _add_pause_routes(app: FastAPI, transfer: VllmTransfer) -> None:
    """The pause a trainer puts around an update, and the prefix cache it may drop."""

    @app.post("/pause")
    async def pause(mode: str = Query("abort")):
        await run(transfer.pause(mode))
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await run(transfer.resume())
        return {"status": "resumed"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(False), reset_external: bool = Query(False)):
        """vLLM's answer: whether every engine dropped its cached prefixes (false while blocks are
        held by running requests: retry). A push's commit resets them itself."""
        del reset_running_requests, reset_external  # no connector-managed cache here
        done = await asyncio.gather(*(e.reset_prefix_cache() for e in transfer.manager.up_engines()))
        return {"success": all(done)}
