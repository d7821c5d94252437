"""SGLang's RL routes on the sidecar's HTTP front (`rollout.serve --http-port P --sglang-routes`): the
paths, bodies and answers of SGLang's python/sglang/srt/entrypoints/http_server.py, so that trainers
written for SGLang servers (slime, AReaL, TorchRL's SGLang weight sync) drive the sidecar unchanged.
What each does is rollout/sidecar/sglang_transfer.py's (over the sidecar's one staged push); /generate is
rollout/sidecar/openai_front/sglang_generate.py's. Answers are SGLang's: `{"success", "message"}` (a failure's
status is 400 when nothing changed because of the request, as SGLang's; 409 another trainer owns the
weight sync; 5xx ours), and the front's token rule holds for them as for every route."""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from rollout.sidecar.openai_front.disconnect import until_disconnected
from rollout.sidecar.openai_front.sglang_generate import BadField, SglangGenerate
from rollout.sidecar.sglang_transfer import SglangTransfer
from rollout.sidecar.foreign_group import TransferError

_encode = msgspec.json.Encoder().encode


async def _body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        body = None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise TransferError(400, "the body must be a JSON object")
    return body


async def _answer(work, message: str = "Success") -> JSONResponse:
    """SGLang's answer: {"success": true, "message", ...what the call says}, or its failure."""
    try:
        out = await work
    except TransferError as e:
        return JSONResponse({"success": False, "message": str(e)}, status_code=e.status)
    return JSONResponse({"success": True, "message": message, **(out or {})})


def add_sglang_routes(app: FastAPI, transfer: SglangTransfer, front, relabel: bool = True) -> None:
    """`relabel`: also /update_weight_version (vLLM's routes serve their own at that path when both are on)."""
    _add_weight_routes(app, transfer)
    _add_control_routes(app, transfer, relabel)
    _add_info_routes(app, transfer, front.model, server_info=relabel)
    _add_generate_route(app, front)


def _add_weight_routes(app: FastAPI, transfer: SglangTransfer) -> None:
    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        return await _answer(_then(_body(request), transfer.init), "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        async def work():
            body = await _body(request)
            await transfer.destroy(body.get("group_name", "weight_update_group"))
        return await _answer(work(), "Succeeded to destroy custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        return await _answer(_then(_body(request), transfer.update_distributed),
                             "Succeeded to update parameter online.")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        return await _answer(_then(_body(request), transfer.update_from_disk), "Succeeded to update model weights.")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor():
        return JSONResponse({"success": False, "message": "update_weights_from_tensor carries CUDA IPC handles of a "
                             "colocated trainer's tensors (pickled): not taken here; use "
                             "/update_weights_from_distributed or /update_weights_from_disk"}, status_code=400)


async def _then(body, fn):
    return await fn(await body)


def _add_control_routes(app: FastAPI, transfer: SglangTransfer, relabel: bool) -> None:
    manager = transfer.manager

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        return await _answer(_then(_body(request), lambda b: transfer.pause(b.get("mode", "abort"))),
                             "Generation paused successfully.")

    @app.post("/continue_generation")
    async def continue_generation():
        return await _answer(transfer.resume(), "Generation continued successfully.")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        done = await asyncio.gather(*(e.reset_prefix_cache() for e in manager.up_engines()))
        return PlainTextResponse("Cache flushed.\n" if all(done) else "Cache not flushed: requests are running.\n",
                                 status_code=200 if all(done) else 400)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation():
        await asyncio.gather(*(e.sleep(level=1) for e in manager.up_engines()))
        return {"success": True, "message": "Memory released (the engines sleep)."}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation():
        await asyncio.gather(*(e.wake_up() for e in manager.up_engines()))
        return {"success": True, "message": "Memory resumed (the engines are awake)."}

    if relabel:
        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            async def work():
                new = (await _body(request)).get("new_version")
                if new != str(transfer.pushes.version):
                    raise TransferError(400, f"new_version {new!r}: this sidecar's weight versions name the pushed "
                                             f"weights (version {transfer.pushes.version} is served), so a version "
                                             "changes only with new weights: pass weight_version to the update")
                return {"new_version": new}
            return await _answer(work(), "Weight version updated")


def _add_info_routes(app: FastAPI, transfer: SglangTransfer, model: str, server_info: bool = True) -> None:
    """SGLang's newer paths too (/model_info, /server_info: TorchRL reads those); /server_info is
    vLLM's own when its routes are on (`server_info` False)."""
    manager = transfer.manager

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(manager.version)}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info():
        return {"model_path": model, "tokenizer_path": model, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": str(manager.version),
                "has_image_understanding": False, "has_audio_understanding": False}

    async def get_server_info():
        engines = manager.up_engines() or manager.engines
        return {"model_path": model, "served_model_name": model, "tp_size": transfer.world_size(), "dp_size": 1,
                "device": str(engines[0].cfg.device).split(":")[0], "dtype": engines[0].cfg.dtype,
                "context_length": manager.max_model_len, "weight_version": str(manager.version),
                "version": "rollout-sidecar", "internal_states": [{"weight_version": str(manager.version)}]}

    app.get("/get_server_info")(get_server_info)
    if server_info:
        app.get("/server_info")(get_server_info)

    @app.get("/get_load")
    async def get_load():
        """SGLang's load per data-parallel rank (here one engine each): a paused engine runs none of
        its requests (TorchRL polls this after /pause_generation until nothing runs)."""
        loads = []
        for i, engine in enumerate(manager.engines):
            queued = manager.load[i]
            running = 0 if engine.errored or await engine.is_paused() else queued
            loads.append({"dp_rank": i, "num_reqs": queued, "num_running_reqs": running,
                          "num_waiting_reqs": queued - running, "num_tokens": 0})
        return loads


def _add_generate_route(app: FastAPI, front) -> None:
    @app.post("/generate")
    async def generate(request: Request):
        from rollout.sidecar.openai_front.generation import whole_choices

        try:
            job = SglangGenerate(front, await _body(request))
        except (BadField, ValueError, TransferError) as e:
            return JSONResponse({"error": {"message": str(e), "param": getattr(e, "param", None)}, "object": "error",
                                 "message": str(e), "code": 400}, status_code=400)
        if job.body.get("stream"):
            return StreamingResponse(_lines(job), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return job.whole(await until_disconnected(request, whole_choices(front.manager, job.prompts, job.params)))


async def _lines(job: SglangGenerate):
    from rollout.sidecar.group_stream import ShuttingDown
    from rollout.sidecar.supervision import NoEngineError

    try:
        async for chunk in job.chunks():
            yield b"data: " + _encode(chunk) + b"\n\n"
    except (NoEngineError, ShuttingDown) as e:  # the status is out already: an error event
        yield b"data: " + _encode({"error": {"message": str(e), "code": 503}}) + b"\n\n"
    yield b"data: [DONE]\n\n"
