"""How long a sidecar takes to serve: seconds from `python -m rollout.serve` to its READY line, per
process, with each process's import profile; and how long a heal takes (SIGKILL of an engine core
to health "ok" again).

    python -m bench.startup                  # tiny model, 3 starts
    python -m bench.startup --vllm           # also vLLM's engine (--engine vllm) beside ours

The anchor is the floor of any engine core on torch: one bare interpreter importing torch and
nothing else (`floor`); ours/floor says how much of a start is ours. Beside it, the floor of a core
that loads its model with transformers (torch + the model's transformers class), which ours paid
until it built Llama-shaped models itself (engine/models/llama_model.py). The import profile
(seconds per top-level package, summed over each module's own import time) comes from one extra
start of each process under `python -X importtime`: the front end run as a whole, the engine core
as a warm standby (the imports it makes before its arguments arrive).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict

log = logging.getLogger("bench.startup")
GOAL_READY_S = 4.0  # issue 39, idle 2-core machine
GOAL_HEAL_S = 3.0
PHASE = re.compile(r"(engine core|sidecar) (?:up|READY) in ([\d.]+) s")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}


def start(model_dir: str, *extra: str, importtime: bool = False) -> tuple[subprocess.Popen, float, str, str]:
    """A sidecar started now: (process, seconds to READY, its address, its log so far)."""
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "rollout.serve", "--model",
           model_dir, "--port", "0", "--parent-pid", str(os.getpid()), "--stats-interval", "0",
           "--log-level", "INFO", *extra]
    err = open(f"/tmp/bench-startup-{os.getpid()}.log", "w+")  # noqa: SIM115 - read back below
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=_env())
    for line in proc.stdout:
        if line.startswith("READY "):
            seconds = time.perf_counter() - t0
            err.flush()
            err.seek(0)
            return proc, seconds, line.split()[1], err.read()
    err.seek(0)
    raise RuntimeError(f"sidecar exited with {proc.wait()} before READY:\n{err.read()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def heal_seconds(address: str, warm_s: float) -> float:
    """SIGKILL of the engine core -> the sidecar answers health ok and generates again, once the
    sidecar has served a while (its warm standby core, spawned at the first call, is ready)."""
    from engine import SamplingParams
    from rollout import RolloutClient

    client = RolloutClient(address, timeout_s=120)
    try:
        client.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        time.sleep(warm_s)
        pid = client.health()["engine_states"][0]["pid"]
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while True:
            h = client.health()
            if h["ok"] and h["engine_states"][0]["pid"] != pid:
                break
            time.sleep(0.02)
        client.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        return time.perf_counter() - t0
    finally:
        client.close()


def floor_seconds(model_dir: str, transformers: bool = False) -> float:
    """One interpreter importing torch (and the model's transformers class), nothing else."""
    code = "import os, torch\n" + ("from transformers import AutoConfig, AutoModelForCausalLM\n"
                                   f"AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained({model_dir!r}))]\n"
                                   if transformers else "") + "os._exit(0)"  # as a core ends: no teardown counted
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    return time.perf_counter() - t0


def import_profile(stderr: str) -> dict[str, float]:
    """Seconds of import per top-level package, from `-X importtime` lines (each module's own time,
    so nothing is counted twice)."""
    by_package: dict[str, float] = defaultdict(float)
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, _, name = line[len("import time:"):].split("|")
        by_package[name.strip().split(".")[0]] += int(own) / 1e6
    return dict(by_package)


def core_import_profile(model_dir: str) -> dict[str, float]:
    """A standby core's imports: everything it loads before its arguments arrive."""
    cmd = [sys.executable, "-X", "importtime", "-m", "engine.core_proc", "--standby", model_dir, "--parent-pid",
           str(os.getpid())]
    done = subprocess.run(cmd, input="", capture_output=True, text=True, env=_env(), timeout=300, check=False)
    return import_profile(done.stderr)


def _top(profile: dict[str, float], n: int = 6) -> str:
    total = sum(profile.values())
    top = sorted(profile.items(), key=lambda kv: -kv[1])[:n]
    return f"{total:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in top)


def _phases(log_text: str) -> str:
    return "; ".join(f"{who} {s} s" for who, s in PHASE.findall(log_text)) or "(no phase lines)"


def measure(model_dir: str, runs: int, *extra: str, heal_after_s: float | None = None) -> dict:
    ready, heals, phases = [], [], ""
    for r in range(runs):
        proc, seconds, address, text = start(model_dir, *extra)
        try:
            ready.append(seconds)
            phases = _phases(text)
            if heal_after_s is not None:
                heals.append(heal_seconds(address, heal_after_s))
        finally:
            stop(proc)
        log.info("start %d: READY in %.2f s%s (%s)", r, seconds, f", heal {heals[-1]:.2f} s" if heals else "", phases)
    return {"ready": statistics.median(ready), "heal": statistics.median(heals) if heals else None, "phases": phases}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a model directory or name (tiny, small, smollm2)")
    p.add_argument("--runs", type=int, default=3, help="starts of each kind (medians reported)")
    p.add_argument("--vllm", action="store_true", help="also start --engine vllm (needs vLLM's CPU build)")
    p.add_argument("--no-vllm-cpu-setup", action="store_true",
                   help="run without vLLM's documented CPU set-up (bench/vllm_cpu_setup.py): its figures then are "
                        "not its users'")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench import vllm_cpu_setup

    setup = vllm_cpu_setup.apply("bench.startup", argv, enabled=args.vllm and not args.no_vllm_cpu_setup)
    from engine.models.model_names import resolve_model_arg

    model_dir = resolve_model_arg(args.model)  # built once here, not inside a timed start
    floor = statistics.median(floor_seconds(model_dir) for _ in range(args.runs))
    hf_floor = statistics.median(floor_seconds(model_dir, transformers=True) for _ in range(args.runs))
    ours = measure(model_dir, args.runs, heal_after_s=2 * floor)
    proc, _, _, front_text = start(model_dir, importtime=True)
    stop(proc)
    front, core = import_profile(front_text), core_import_profile(model_dir)
    print(f"floor (torch alone in one interpreter): {floor:.2f} s; with the model's transformers class: "
          f"{hf_floor:.2f} s")
    print(f"ours: READY {ours['ready']:.2f} s (goal <= {GOAL_READY_S}), ready/floor {ours['ready'] / floor:.2f}; "
          f"heal {ours['heal']:.2f} s (goal <= {GOAL_HEAL_S}); per process: {ours['phases']}")
    print(f"imports, front end: {_top(front)}")
    print(f"imports, engine core: {_top(core)}")
    if args.vllm:
        theirs = measure(model_dir, args.runs, "--engine", "vllm")
        print(f"vLLM's engine: READY {theirs['ready']:.2f} s; ours/vLLM {ours['ready'] / theirs['ready']:.2f}; {setup}")


if __name__ == "__main__":
    main()
