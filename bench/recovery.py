"""What an engine's death costs: seconds from SIGKILL of an engine core to the sidecar serving the
newest pushed weights on every engine again, against what a user does without supervision
(stop the sidecar, start a new one, init_weight_sync, push the newest weights again).

    python -m bench.recovery                       # tiny model, 1 and 2 engines
    python -m bench.recovery --model smollm2       # the real model (needs the 'real' extra)

Ours is timed from the kill to health "ok" with every engine at the pushed version; the anchor
from the stop of the old sidecar to the end of the push into the new one. Both include starting
an engine core (loading the checkpoint); ours then catches up from a live sibling (2 engines) or
from the host copy in /dev/shm (1 engine) instead of waiting for the trainer. The catch-up's
bytes/s is set against a plain in-memory copy of the same bytes, the machine's limit for it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import time

import torch

log = logging.getLogger("bench.recovery")
GOAL = 0.5  # ours at most half of the restart-everything path


def _core_pid(client, engine: int) -> int:
    return client.health()["engine_states"][engine]["pid"]


def _start(model_dir: str, engines: int):
    from rollout import RolloutClient
    from rollout.launcher import LocalSidecar

    sidecar = LocalSidecar(model_dir, "--num-engines", str(engines), "--log-level", "WARNING", "--stats-interval", "0",
                           "--host-copy", "on", "--max-restarts", "100")
    return sidecar, RolloutClient(sidecar.url, timeout_s=600)


def ours(model_dir: str, trainer, engines: int, version: int) -> dict:
    sidecar, client = _start(model_dir, engines)
    try:
        client.init_weight_sync()
        client.push_weights(trainer, version=version)
        time.sleep(2.0)  # the host copy is written in the background after a push
        t0 = time.perf_counter()
        os.kill(_core_pid(client, engines - 1), signal.SIGKILL)
        while True:
            h = client.health()
            if h["ok"] and all(s["version"] == version for s in h["engine_states"]):
                break
            time.sleep(0.02)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, **client.stats()["last_restart"]}
    finally:
        client.close()
        sidecar.stop()


def restart_everything(model_dir: str, trainer, engines: int, version: int) -> float:
    sidecar, client = _start(model_dir, engines)
    client.init_weight_sync()
    client.push_weights(trainer, version=version)
    t0 = time.perf_counter()
    client.close()
    sidecar.stop()
    sidecar, client = _start(model_dir, engines)
    try:
        client.init_weight_sync()
        client.push_weights(trainer, version=version)
        return time.perf_counter() - t0
    finally:
        client.close()
        sidecar.stop()


def copy_gbps(nbytes: int) -> float:
    """A plain copy of `nbytes` in memory (the best an in-machine catch-up could do)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from engine.models.model_names import resolve_model_arg

    p = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a model directory or name (tiny, small, smollm2)")
    p.add_argument("--engines", default="1,2", help="engine counts to measure, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="runs of each side per engine count (medians reported)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = resolve_model_arg(args.model)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(0.01)  # weights unlike the checkpoint: a catch-up must really move them
    nbytes = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
    limit = copy_gbps(nbytes)
    rows = []
    for engines in [int(x) for x in args.engines.split(",")]:
        mine, theirs = [], []
        for r in range(args.repeats):
            mine.append(ours(model_dir, trainer, engines, version=r + 1))
            theirs.append(restart_everything(model_dir, trainer, engines, version=r + 1))
            log.info("%d engine(s), run %d: ours %.2f s, restart everything %.2f s", engines, r,
                     mine[-1]["seconds"], theirs[-1])
        ours_s = statistics.median(m["seconds"] for m in mine)
        base_s = statistics.median(theirs)
        catch = statistics.median(m["catch_up_s"] for m in mine)
        rows.append((engines, ours_s, base_s, statistics.median(m["start_s"] for m in mine), catch,
                     mine[0]["source"], nbytes / catch / 1e9 if catch > 0 else float("nan")))
    print(f"\nmodel {args.model} ({nbytes / 1e6:.0f} MB of weights), {args.repeats} runs each, medians; "
          f"plain memory copy {limit:.2f} GB/s")
    print(f"{'engines':>7} {'ours s':>8} {'restart all s':>14} {'ratio':>6} {'engine start s':>15} "
          f"{'catch-up s':>11} {'from':>10} {'catch-up GB/s':>14} {'of copy':>8}")
    for engines, o, b, start, catch, source, gbps in rows:
        print(f"{engines:>7} {o:>8.2f} {b:>14.2f} {o / b:>6.2f} {start:>15.2f} {catch:>11.3f} {source:>10} "
              f"{gbps:>14.2f} {gbps / limit:>8.2f}")
    print(f"goal: ratio <= {GOAL}")


if __name__ == "__main__":
    main()
