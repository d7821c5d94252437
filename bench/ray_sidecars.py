"""Sidecars launched by Ray against sidecars launched by hand, on this machine, in one run.

    python -m bench.ray_sidecars                    # tiny model, 2 sidecars, 10 pushes each way
    python -m bench.ray_sidecars --model smollm2    # the real model (needs the 'real' extra)

1. Push time: the same trainer pushes to 2 Ray-launched sidecars (rollout.ray_launcher) and to 2
   hand-launched ones (rollout.launcher.LocalSidecar), alternately, so both see the same machine
   state; medians and their ratio (goal: Ray within 5% of by hand). Bytes/s is set against an
   in-memory copy of the same bytes, the bound of any loopback link (bench.weight_sync gives the
   share of a raw gloo broadcast).
2. Back in rotation: seconds from SIGKILL of one sidecar to it serving the newest weights again.
   Ray: the actor's process is killed, Ray restarts it, the client takes the new sidecar back at
   its next call and the next push reaches it (goal: within 30 s of Ray's restart). By hand: the
   sidecar's process is killed, a new one is started, `add_sidecar`, push.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import signal
import statistics
import time

import torch

log = logging.getLogger("bench.ray_sidecars")
SERVE_ARGS = ["--log-level", "WARNING", "--stats-interval", "0", "--warm-standby", "off", "--host-copy", "off"]


def _nudge(model, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-4 * (1 if step % 2 else -1))


def _push_seconds(client, trainer, version: int) -> float:
    t = time.perf_counter()
    client.push_weights(trainer, version=version, delta=False)
    return time.perf_counter() - t


def push_times(ray_client, hand_client, trainer, pushes: int) -> dict:
    for c in (ray_client, hand_client):  # warm-up: the layout is built and the groups formed
        c.init_weight_sync()
        c.push_weights(trainer, version=1, delta=False)
    times = {"ray": [], "hand": []}
    for k in range(pushes):
        _nudge(trainer, k)
        order = [("ray", ray_client), ("hand", hand_client)][:: 1 if k % 2 else -1]
        for name, c in order:
            times[name].append(_push_seconds(c, trainer, 2 + k))
    return {name: statistics.median(ts) for name, ts in times.items()}


def copy_seconds(nbytes: int, repeats: int = 5) -> float:
    """One in-memory copy of `nbytes` (median): the bound no loopback transfer can beat."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _serving(client, version_want: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(c != version_want for c in client.weights_checksums()):
        assert time.monotonic() < deadline, "the weights never arrived"
        time.sleep(0.05)


def back_in_rotation_ray(sidecars, client, trainer, version: int) -> dict:
    from weight_sync import weights_checksum

    victim = sidecars.info(1)
    t0 = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    while sidecars.info(1)["pid"] == victim["pid"]:  # Ray answers once the restarted actor is up
        time.sleep(0.05)
    restarted = time.monotonic() - t0
    while victim["url"] in client.urls or len(client.urls) < 2:  # the client's next call takes it back
        client.health()
        time.sleep(0.05)
    client.push_weights(trainer, version=version, delta=False)
    _serving(client, weights_checksum(trainer.named_parameters()))
    return {"restarted_s": restarted, "serving_s": time.monotonic() - t0}


def back_in_rotation_by_hand(model_dir: str, hand: list, client, trainer, version: int, token: str) -> dict:
    from rollout.launcher import LocalSidecar
    from weight_sync import weights_checksum

    t0 = time.monotonic()
    old = hand.pop()
    old.proc.kill()
    old.proc.wait()
    client.remove_sidecar(old.url)
    new = LocalSidecar(model_dir, *SERVE_ARGS, token=token)
    hand.append(new)
    started = time.monotonic() - t0
    client.add_sidecar(new.url)
    client.push_weights(trainer, version=version, delta=False)
    _serving(client, weights_checksum(trainer.named_parameters()))
    return {"restarted_s": started, "serving_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (default), another embedded name, smollm2, or a directory")
    p.add_argument("--pushes", type=int, default=10, help="timed pushes each way")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs the local Ray cluster declares")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(os.cpu_count() or 1)

    import ray
    from transformers import AutoModelForCausalLM

    from engine.models.model_names import resolve_model_arg
    from rollout import RolloutClient
    from rollout.launcher import LocalSidecar
    from rollout.ray_launcher import RaySidecars

    model_dir = resolve_model_arg(args.model)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, logging_level="WARNING")
    sidecars = RaySidecars(model_dir, 2, SERVE_ARGS, max_restarts=5)
    hand = [LocalSidecar(model_dir, *SERVE_ARGS, token=sidecars.token) for _ in range(2)]
    ray_client, hand_client = sidecars.client(), RolloutClient([h.url for h in hand], token=sidecars.token)
    try:
        pushes = push_times(ray_client, hand_client, copy.deepcopy(trainer), args.pushes)
        ray_back = back_in_rotation_ray(sidecars, ray_client, trainer, 1000)
        hand_back = back_in_rotation_by_hand(model_dir, hand, hand_client, trainer, 1000, sidecars.token)
    finally:
        ray_client.close()
        hand_client.close()
        for h in hand:
            h.stop()
        sidecars.shutdown()
        ray.shutdown()
    ratio, copy_s = pushes["ray"] / pushes["hand"], copy_seconds(nbytes)
    print(f"model {args.model}: {nbytes / 2**20:.1f} MiB fp32, 2 sidecars, {args.pushes} pushes each way (medians)")
    print(f"push    Ray {pushes['ray'] * 1e3:8.1f} ms ({nbytes / pushes['ray'] / 2**20:7.1f} MiB/s)   "
          f"by hand {pushes['hand'] * 1e3:8.1f} ms ({nbytes / pushes['hand'] / 2**20:7.1f} MiB/s)   "
          f"Ray/by hand {ratio:.3f} (goal <= 1.05: {'met' if ratio <= 1.05 else 'MISSED'})")
    print(f"        bytes/s as a share of an in-memory copy ({nbytes / copy_s / 2**20:.0f} MiB/s): "
          f"Ray {copy_s / pushes['ray']:.3f}, by hand {copy_s / pushes['hand']:.3f}")
    print(f"back    Ray: restarted {ray_back['restarted_s']:.1f} s after the kill, serving the newest weights "
          f"{ray_back['serving_s']:.1f} s after it ({ray_back['serving_s'] - ray_back['restarted_s']:.1f} s after the "
          f"restart; goal <= 30: {'met' if ray_back['serving_s'] - ray_back['restarted_s'] <= 30 else 'MISSED'})")
    print(f"        by hand: new sidecar up {hand_back['restarted_s']:.1f} s after the kill, serving "
          f"{hand_back['serving_s']:.1f} s after it")


if __name__ == "__main__":
    main()
