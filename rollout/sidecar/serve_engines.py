"""The engines a sidecar serves and the rollout manager over them, built from the flags: our
engine (each core started early, as a warm standby, before the front end imports torch) or vLLM's,
on the devices the flags place them on; the manager restarts a dead one the same way."""

from __future__ import annotations


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
    from rollout.sidecar.manager import RolloutManager
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
                        prepack_linears=args.prepack_linears == "on", quantization=args.quantization,
                        head_dtype=args.head_dtype, batch_invariant=args.batch_invariant == "on",
                        enforce_eager=getattr(args, "enforce_eager", False), **extra)


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

    # overlapped pushes stage a copy of the weights: it is made ready at start (and, on CUDA, kept out
    # of the KV cache's share), unless a staging limit says pushes may go in place
    reserve = args.overlap_receive == "on" and args.staging_memory_limit_mb is None

    def make_engine(i: int, standby=None) -> AsyncEngine:
        cfg = config(i, lora_versions=args.lora_versions, reserve_push_staging=reserve,
                     worker_extension_cls="weight_sync.engine_side.extension:WeightSyncExtension")
        return AsyncEngine(cfg, log_level=args.log_level, standby=standby)

    return make_engine


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
