"""Where a large push's time and memory go, beside raw gloo for the same bytes (issue 61).

For each shape (bench.model_shapes: random weights in the family's real config, SmolLM2's
tokenizer) and dtype, in one run:

  raw    gloo broadcasts of the push's bytes from this process (rank 0) to a receiver process
         (rank 1), in the push's 64 MiB buckets with four in flight, both buffers touched once
         before: what the link (here loopback) and the cores carry at best. Measured before and
         after the pushes (the machine drifts); the median of all rounds is the anchor.
  full   a real sidecar (`python -m rollout.serve --model DIR --dtype D`, its defaults otherwise),
         this process its trainer with the model loaded as a user loads it (`from_pretrained`, not
         flattened): `push_weights(model, delta=False)` --pushes times, the first one included,
         each after an in-place write of every weight (what an optimizer step does) and a pause of
         --step-seconds (the training step the push follows).
  delta  then `push_weights(model, delta=True)`: the first sends the full weights and keeps them
         as the base, the next --deltas ones only the elements a step changed (--delta-fraction of
         each tensor's, the fraction GRPO's steps change in bf16: bench/RESULTS.md).

Per push: seconds as the trainer sees them (its call to the reply: every engine committed), GB/s
of the full weights, and the ratio raw / push; the trainer's phases (list, gate: until every
worker is ready, vote, buckets: pack, hash, wire_wait inside it, commit_vote) and the engine's
(check, staging, gate, vote, buckets: wire_wait and hash inside, commit_vote, derive, finish:
until the engine's loop takes the swap, commit); the sidecar's resident memory (every process of
it: front end, engine cores, warm standby) plus the files it keeps in /dev/shm (the host copy),
against the model's bytes. Checksums are compared after the last push of each kind.

    python -m bench.push_scale                                   # 135M, 1B, 1.7B in bf16; 135M in fp32
    python -m bench.push_scale --shapes smollm2-1.7b --pushes 10 --deltas 0
    python -m bench.push_scale --quick                           # 135M bf16, 2 pushes: a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time

import torch

log = logging.getLogger("bench.push_scale")
BUCKET = 64 << 20
IN_FLIGHT = 4


# -- raw gloo ---------------------------------------------------------------------------------
def _raw_rounds(group, buf: torch.Tensor, rounds: int) -> list[float]:
    """Rank 0 or 1: `rounds` broadcasts of `buf` in BUCKET slices, IN_FLIGHT posted, each round
    closed by a one-integer all-gather; seconds per round (as rank 0 sees them)."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        inflight = []
        for start in range(0, buf.numel(), BUCKET):
            if len(inflight) >= IN_FLIGHT:
                group.wait(inflight.pop(0))
            inflight.append(group.broadcast(buf[start:start + BUCKET], src=0))
        for w in inflight:
            group.wait(w)
        group.allgather(torch.zeros(1, dtype=torch.int64))
        out.append(time.perf_counter() - t0)
    return out


def raw_receiver(info: dict) -> None:
    """The receiving process of `raw_gloo` (python -m bench.push_scale --raw-receiver JSON)."""
    from weight_sync.common.group import WeightSyncGroup

    g = WeightSyncGroup.connect(host=info["host"], port=info["port"], world_size=2, rank=1,
                                group_name=info["group_name"], secret=info["secret"], timeout_s=info["timeout_s"])
    buf = torch.ones(info["nbytes"], dtype=torch.uint8)
    _raw_rounds(g, buf, info["rounds"])
    g.close()


def raw_gloo(nbytes: int, rounds: int) -> list[float]:
    """Seconds per round of `rounds` raw broadcasts of `nbytes` to a receiver process."""
    from weight_sync.common.group import WeightSyncGroup

    g = WeightSyncGroup.master(world_size=2, timeout_s=300.0)
    info = {**g.connection_info(), "nbytes": nbytes, "rounds": rounds}
    child = subprocess.Popen([sys.executable, "-m", "bench.push_scale", "--raw-receiver", json.dumps(info)],
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])})
    try:
        g.join()
        buf = torch.ones(nbytes, dtype=torch.uint8)
        seconds = _raw_rounds(g, buf, rounds)
        child.wait(60)
        return seconds
    finally:
        g.close()
        if child.poll() is None:
            child.kill()
            child.wait()


# -- the sidecar's memory -----------------------------------------------------------------------
def sidecar_memory(pid: int) -> dict:
    """Resident bytes of the sidecar's processes (VmRSS: shared files they map included), and of the
    /dev/shm files its tree owns that none of them maps (a written host copy; a host copy that links
    an engine's staging buffer is that buffer, counted once)."""
    from rollout.launcher import descendants

    rss, mapped = 0, set()
    pids = [pid, *descendants(pid)]
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                rss += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
            with open(f"/proc/{p}/maps") as f:
                mapped |= {int(cols[4]) for cols in (line.split() for line in f)
                           if len(cols) > 5 and cols[5].startswith("/dev/shm/")}
        except (OSError, StopIteration):
            pass
    shm = 0
    for root, _, files in os.walk("/dev/shm"):
        for name in files:
            path = os.path.join(root, name)
            if any(f"-{p}-" in path for p in pids):
                st = os.stat(path)
                shm += 0 if st.st_ino in mapped else st.st_size
    return {"rss": rss, "shm": shm}


# -- the pushes -----------------------------------------------------------------------------------
def _step(model: torch.nn.Module, fraction: float, k: int) -> None:
    """An optimizer step's write: every element (fraction 1) or one in 1/fraction of each tensor
    (a different one each step), negated in place."""
    stride = max(1, round(1 / fraction))
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[k % stride::stride].neg_()


def _row(kind: str, i: int, reply: dict, seconds: float, full_bytes: int, raw_s: float, mem: dict,
         model_bytes: int) -> dict:
    side = reply["sidecars"][0]
    return {"kind": kind, "push": i, "seconds": seconds, "gbps": full_bytes / seconds / 1e9, "of_raw": raw_s / seconds,
            "wire_bytes": reply["trainer"]["bytes"], "delta": reply.get("delta", False),
            "trainer": reply["trainer"].get("phases", {}), "engine": side.get("engine_phases", {}),
            "swap_seconds": side.get("swap_seconds"), "rss_gb": mem["rss"] / 1e9, "shm_gb": mem["shm"] / 1e9,
            "memory_x": (mem["rss"] + mem["shm"]) / model_bytes}


async def pushes(args, model_dir: str, dtype: str, raw_s: float, pid: int, url: str) -> tuple[list[dict], dict]:
    from transformers import AutoModelForCausalLM

    from rollout.client import AsyncRolloutClient

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    client = AsyncRolloutClient(url)
    rows, checks = [], {}
    try:
        await client.init_weight_sync()
        start = sidecar_memory(pid)
        log.info("sidecar before any push: %.2f GB resident + %.2f GB in /dev/shm (%.2fx the model's %.2f GB)",
                 start["rss"] / 1e9, start["shm"] / 1e9, (start["rss"] + start["shm"]) / model_bytes, model_bytes / 1e9)
        version = 0
        plan = [("full", False, 1.0)] * args.pushes + [("delta", True, args.delta_fraction)] * \
            (args.deltas + 1 if args.deltas else 0)
        for i, (kind, delta, fraction) in enumerate(plan):
            _step(model, fraction, i)
            await asyncio.sleep(args.step_seconds)
            version += 1
            t0 = time.perf_counter()
            reply = await client.push_weights(model, version, delta=delta)
            seconds = time.perf_counter() - t0
            row = _row(kind, i, reply, seconds, model_bytes, raw_s, sidecar_memory(pid), model_bytes)
            rows.append(row)
            log.info("%s push %d: %.2f s (%.2f GB/s, %.2f of raw gloo), %.1f MB on the wire; sidecar %.2f GB + "
                     "%.2f GB shm = %.2fx the model", kind, i + 1, seconds, row["gbps"], row["of_raw"],
                     row["wire_bytes"] / 1e6, row["rss_gb"], row["shm_gb"], row["memory_x"])
            if i + 1 == len(plan) or plan[i + 1][0] != kind:
                checks[kind] = (await client.weights_checksums()) == [client.checksum_of(model)]
        return rows, {"model_bytes": model_bytes, "start": start, "checksums_equal": checks}
    finally:
        await client.close()


def run_case(args, shape: str, dtype: str) -> dict:
    from bench.model_shapes import shape_dir
    from rollout.launcher import LocalSidecar

    model_dir = str(shape_dir(shape, "bfloat16"))
    nbytes = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                 if f.endswith(".safetensors")) * (2 if dtype == "float32" else 1)
    raw = raw_gloo(nbytes, args.raw_rounds)
    log.info("%s %s: raw gloo %.3f s for %.2f GB (%.2f GB/s)", shape, dtype, statistics.median(raw), nbytes / 1e9,
             nbytes / statistics.median(raw) / 1e9)
    extra = ["--dtype", dtype, "--log-level", "WARNING", "--stats-interval", "0", *args.sidecar_arg]
    with LocalSidecar(model_dir, *extra) as sidecar:
        rows, info = asyncio.run(pushes(args, model_dir, dtype, statistics.median(raw), sidecar.proc.pid, sidecar.url))
    raw += raw_gloo(nbytes, args.raw_rounds)
    raw_s = statistics.median(raw)
    for r in rows:  # against every raw round's median, before and after
        r["of_raw"] = raw_s / r["seconds"]
    return {"shape": shape, "dtype": dtype, "raw_seconds": raw, "raw_median": raw_s, "rows": rows, **info}


def report(case: dict) -> None:
    mb = case["model_bytes"]
    print(f"\n{case['shape']} {case['dtype']}: {mb / 1e9:.2f} GB; raw gloo median {case['raw_median']:.3f} s "
          f"({mb / case['raw_median'] / 1e9:.2f} GB/s) over {len(case['raw_seconds'])} rounds; checksums equal: "
          f"{case['checksums_equal']}; before any push {case['start']['rss'] / 1e9:.2f} GB + "
          f"{case['start']['shm'] / 1e9:.2f} GB shm")
    print(f"{'kind':6s} {'push':>4s} {'s':>7s} {'GB/s':>6s} {'/raw':>5s} {'wire MB':>8s} {'mem x':>6s}  phases: trainer | engine")
    for r in case["rows"]:
        tr = " ".join(f"{k}={v:.2f}" for k, v in r["trainer"].items() if v >= 0.005)
        en = " ".join(f"{k}={v:.2f}" for k, v in r["engine"].items() if v >= 0.005)
        print(f"{r['kind']:6s} {r['push'] + 1:4d} {r['seconds']:7.3f} {r['gbps']:6.2f} {r['of_raw']:5.2f} "
              f"{r['wire_bytes'] / 1e6:8.1f} {r['memory_x']:6.2f}  {tr} | {en}")
    for kind in ("full", "delta"):
        rs = [r for r in case["rows"] if r["kind"] == kind]
        if rs:
            steady = rs[1:] or rs
            print(f"  {kind}: first {rs[0]['seconds']:.3f} s ({rs[0]['of_raw']:.2f} of raw), steady median "
                  f"{statistics.median(r['seconds'] for r in steady):.3f} s "
                  f"({statistics.median(r['of_raw'] for r in steady):.2f} of raw); worst of raw "
                  f"{min(r['of_raw'] for r in rs):.2f}; memory at most {max(r['memory_x'] for r in rs):.2f}x the model")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.push_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm2-135m,llama3.2-1b,smollm2-1.7b", help="bench.model_shapes names")
    p.add_argument("--dtypes", default="bfloat16", help="engine and push dtypes (float32 runs only on the 135M "
                                                         "shape unless --fp32-all: memory)")
    p.add_argument("--fp32-all", action="store_true", help="float32 on every shape (needs ~5x the model's bytes free)")
    p.add_argument("--pushes", type=int, default=5, help="full pushes, the first included")
    p.add_argument("--deltas", type=int, default=3, help="delta pushes after the anchor (0: none)")
    p.add_argument("--delta-fraction", type=float, default=0.035, help="share of each tensor a step changes")
    p.add_argument("--step-seconds", type=float, default=3.0, help="pause before each push (the training step)")
    p.add_argument("--raw-rounds", type=int, default=3, help="raw gloo rounds before and after the pushes")
    p.add_argument("--sidecar-arg", action="append", default=[], help="one more argument for rollout.serve (repeat)")
    p.add_argument("--quick", action="store_true", help="the 135M shape in bf16, 2 pushes, 1 delta: a smoke run")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    p.add_argument("--raw-receiver", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw_receiver:
        return raw_receiver(json.loads(args.raw_receiver))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.quick:
        args.shapes, args.dtypes, args.pushes, args.deltas, args.step_seconds, args.raw_rounds = \
            "smollm2-135m", "bfloat16", 2, 1, 1.0, 2
    cases = []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            if dtype == "float32" and shape != "smollm2-135m" and not args.fp32_all:
                log.info("skipping %s in float32: --fp32-all to run it (memory)", shape)
                continue
            case = run_case(args, shape, dtype)
            report(case)
            cases.append(case)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cases, f, indent=1)


if __name__ == "__main__":
    main()
