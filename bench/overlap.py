"""What a weight push costs the rollouts, with the overlapped receive (`--overlap-receive on`:
the bytes arrive while the engines decode, which pause only for the swap) against the old path
(`off`: the engines pause for the whole transfer), on the same sidecar settings.

For each model and each setting, with rollouts decoding all the time (batches of short
requests, back to back):
  - per push: the trainer's push seconds, the workers' transfer seconds, and the pause window
    (the sidecar's `pause_seconds` for that push: from the pause request to the engines resumed,
    the time no decode step can run);
  - rollout tokens/s over a window with a push every `--interval` seconds, against the same
    window with no push (goal >= 0.9 with overlap on).
  - with overlap on, how long a push in wait mode holds the trainer while requests of ~2 s are
    decoding: `push_weights(wait=True)` (until the engines swapped, after those requests) against
    `wait=False` (until the trainer's bytes are out).
Goals (issue 15): pause window <= 10 ms and not growing with the model (medium within 2x of small).

    python -m bench.overlap                          # small (208 MB)
    python -m bench.overlap --models small,medium    # and medium (2 GB; several minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

log = logging.getLogger("bench.overlap")


async def measure(url: str, model_dir: str, pushes: int, interval: float, window: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine import SamplingParams
    from rollout import AsyncRolloutClient

    client = AsyncRolloutClient(url)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    await client.init_weight_sync()
    version = 1
    await client.push_weights(trainer, version=version, delta=False)  # warm-up: the staging memory's first touch
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(16)]
    tokens, running = [0], [True]

    async def load():
        while running[0]:
            groups = await client.generate(prompts, params)
            tokens[0] += sum(len(r.token_ids) for g in groups for r in g)

    loader = asyncio.ensure_future(load())
    try:
        await asyncio.sleep(1.0)
        rows = []
        for _ in range(pushes):  # one at a time, rollouts decoding throughout
            before = (await client.stats())[0]["pause_seconds"]
            t0 = time.perf_counter()
            version += 1
            out = await client.push_weights(trainer, version=version, delta=False)
            seconds = time.perf_counter() - t0
            pause = (await client.stats())[0]["pause_seconds"] - before
            rows.append({"push_s": seconds, "transfer_s": out["sidecars"][0]["transfer_seconds"], "pause_s": pause})
            await asyncio.sleep(0.5)

        async def window_rate(push_every: float | None) -> float:
            nonlocal version
            start, t0 = tokens[0], time.perf_counter()
            next_push = t0 + (push_every or 0)
            while time.perf_counter() - t0 < window:
                if push_every is None:
                    await asyncio.sleep(0.1)
                    continue
                await asyncio.sleep(max(0.0, next_push - time.perf_counter()))  # one push starts every interval
                next_push += push_every
                version += 1
                await client.push_weights(trainer, version=version, delta=False)
            return (tokens[0] - start) / (time.perf_counter() - t0)

        quiet = await window_rate(None)
        busy = await window_rate(interval)
        held = {}
        for wait in (True, False):  # in wait mode the swap waits for the long requests; the trainer need not
            long = asyncio.ensure_future(client.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=200,
                                                                                        ignore_eos=True)))
            await asyncio.sleep(0.3)
            version += 1
            t0 = time.perf_counter()
            out = await client.push_weights(trainer, version=version, pause_mode="wait", wait=wait, delta=False)
            held[wait] = time.perf_counter() - t0
            if not wait:
                await out
            await long
    finally:
        running[0] = False
        await asyncio.gather(loader, return_exceptions=True)
        await client.close()
    return {"rows": rows, "quiet_tps": quiet, "busy_tps": busy, "held_wait_s": held[True], "held_nowait_s": held[False]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small", help="comma-separated model names or directories")
    p.add_argument("--pushes", type=int, default=4, help="pushes timed one by one per setting")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between pushes in the throughput window")
    p.add_argument("--window", type=float, default=12.0, help="seconds of each throughput window")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("weight_sync").setLevel(logging.WARNING)
    from pathlib import Path

    from engine.models.model_names import resolve_model_arg
    from rollout.launcher import LocalSidecar

    results = {}
    for name in args.models.split(","):
        model_dir = resolve_model_arg(name)
        mb = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**20
        for overlap in ("off", "on"):
            sidecar = LocalSidecar(model_dir, "--overlap-receive", overlap, "--max-model-len", "256",
                                   "--stats-interval", "0", "--log-level", "WARNING", "--host-copy", "off")
            try:
                r = asyncio.run(measure(sidecar.url, model_dir, args.pushes, args.interval, args.window))
            finally:
                sidecar.stop()
            results[(name, overlap)] = (mb, r)
            log.info("%s overlap %s: %s", name, overlap, r)
    print(f"\n{'model':8} {'MB':>6} {'overlap':>7} {'push s':>7} {'transfer s':>10} {'pause ms':>9} "
          f"{'tok/s quiet':>11} {'tok/s pushing':>13} {'ratio':>6}")
    for (name, overlap), (mb, r) in results.items():
        med = {k: statistics.median(row[k] for row in r["rows"]) for k in ("push_s", "transfer_s", "pause_s")}
        print(f"{name:8} {mb:6.0f} {overlap:>7} {med['push_s']:7.3f} {med['transfer_s']:10.3f} "
              f"{med['pause_s'] * 1e3:9.1f} {r['quiet_tps']:11.0f} {r['busy_tps']:13.0f} "
              f"{r['busy_tps'] / r['quiet_tps']:6.2f}")
    print(f"\n{'model':8} {'trainer held, wait=True s':>26} {'wait=False s':>13} {'ratio':>6}   (wait mode, overlap on)")
    for (name, overlap), (mb, r) in results.items():
        if overlap == "on":
            print(f"{name:8} {r['held_wait_s']:26.3f} {r['held_nowait_s']:13.3f} "
                  f"{r['held_nowait_s'] / r['held_wait_s']:6.2f}")
    print(f"goals: pause <= 10 ms and not growing with the model; tok/s with a push every {args.interval:.0f} s "
          ">= 0.9 of none (overlap on)")


if __name__ == "__main__":
    main()
