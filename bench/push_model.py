"""The push past this machine, on paper (issue 61 item 6): push time and host memory for 8B, 70B and
a 1T mixture of experts over the chain fan-out (weight_sync/common/fan_out.py), checked first
against the points this project measured (bench/RESULTS.md), then beside the anchors.

The model. A push moves B bytes (the weights in the wire dtype). Down a chain of H sidecar hosts
each byte crosses each link once, and a host passes a chunk on while it receives the next, so the
time is the first link's, plus one chunk per further hop, plus a fixed part (votes, swap):

    T(B, H) = B / (e * L) + (H - 1) * C / (e * L) + t0

L is the link's rate, e the share of it a push reaches (what the phases cost beside the wire:
hashing, packing, staging; bench.push_scale measures it against raw gloo), C the chunk a host
passes on (4 MiB: weight_sync/common/fan_out.py).
Host memory per engine: the served weights, the kept staging buffer (the next push's), and the
host copy (a link to the served weights: no bytes of its own), so 2 B plus the processes; the
trainer holds none (zero-copy sends; a delta's base is one more B, on the trainer).

Every worker receives full tensors (its engine is one device, or vLLM's loaders take their shard
of them), so one host must hold 2 B: that is where this design stops (70B in bf16 is 280 GB
a host), and where the anchors go another way: each GPU receives only its own shard, point to
point (Kimi K2's 1T to 128 GPUs in 1.3 s), which is the next step for models past one host.

    python -m bench.push_model            # the fit against the measured points, then the table
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9
CHUNK = 4 * 2**20  # fan_out.MAX_CHUNK: what a host passes on while it receives the next


@dataclass(frozen=True)
class Point:
    """A measured push: bytes, link GB/s (raw), hosts, seconds; and where it was measured."""

    what: str
    nbytes: float
    link: float
    hosts: int
    seconds: float


# bench/RESULTS.md: bench.hosts (tc tbf 500 Mbit/s links, the small model and SmolLM2 in bf16; EPYC,
# 2026-11-26/27) and bench.push_scale (loopback, raw gloo 2.42 GB/s, SmolLM2-1.7B shape; Xeon, 2026-12-01)
MEASURED = [
    Point("small bf16, 1 host, 500 Mbit/s", 104e6, 0.0625, 1, 1.79),
    Point("small bf16, 3 hosts chain, 500 Mbit/s", 104e6, 0.0625, 3, 2.04),
    Point("SmolLM2 bf16, 1 host, 500 Mbit/s", 269e6, 0.0625, 1, 4.68),
    Point("SmolLM2 bf16, 3 hosts chain, 500 Mbit/s", 269e6, 0.0625, 3, 5.19),
    Point("SmolLM2-1.7B bf16, loopback (steady)", 3.42e9, 2.42, 1, 1.71),
]

# (name, parameters, bytes a parameter on the wire)
MODELS = [("Llama-3.1-8B bf16", 8.0e9, 2), ("Llama-3.1-70B bf16", 70.6e9, 2),
          ("Kimi K2 (1T MoE) fp8", 1.04e12, 1), ("Kimi K2 (1T MoE) bf16", 1.04e12, 2)]
LINKS = [("25 Gbit/s Ethernet", 25 / 8), ("100 Gbit/s", 100 / 8), ("400 Gbit/s", 400 / 8)]
ANCHORS = ["Kimi K2 1T to 128 GPUs in 1.3 s (Perplexity, RDMA point to point, sharded)",
           "Awex: a trillion-parameter model in 6-10 s", "checkpoint-engine: ~20 s for 1T across thousands of GPUs"]


def push_seconds(nbytes: float, link: float, hosts: int, efficiency: float, t0: float = 0.05,
                 chunk: float = CHUNK) -> float:
    """T(B, H) of the module doc; `link` in GB/s."""
    rate = efficiency * link * GB
    return nbytes / rate + (hosts - 1) * chunk / rate + t0


def host_bytes(nbytes: float, processes: float = 1.2e9) -> float:
    """An engine host's memory for a model of `nbytes` (served + kept staging + the processes)."""
    return 2 * nbytes + processes


def fit_efficiency(points: list[Point], t0: float = 0.05) -> float:
    """The e that best fits `points` (least squares on the seconds, over a grid)."""
    grid = [i / 1000 for i in range(300, 1001)]
    return min(grid, key=lambda e: sum((push_seconds(p.nbytes, p.link, p.hosts, e, t0) - p.seconds) ** 2
                                       / p.seconds ** 2 for p in points))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.push_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="1,8,32", help="sidecar hosts down the chain")
    args = p.parse_args(argv)
    e = fit_efficiency(MEASURED)
    print(f"fitted share of the link a push reaches: e = {e:.2f}")
    print(f"{'measured point':44s} {'measured s':>10s} {'model s':>8s} {'model/measured':>14s}")
    for pt in MEASURED:
        model = push_seconds(pt.nbytes, pt.link, pt.hosts, e)
        print(f"{pt.what:44s} {pt.seconds:10.2f} {model:8.2f} {model / pt.seconds:14.2f}")
    hosts = [int(h) for h in args.hosts.split(",")]
    print(f"\n{'model':26s} {'GB':>7s} {'host GB':>8s}  " + "  ".join(f"{n} x{h:<3d}" for n, _ in LINKS for h in hosts))
    for name, params, width in MODELS:
        nbytes = params * width
        cells = [f"{push_seconds(nbytes, link, h, e):{len(n) + 4}.1f}" for n, link in LINKS for h in hosts]
        print(f"{name:26s} {nbytes / GB:7.0f} {host_bytes(nbytes) / GB:8.0f}  " + "  ".join(cells))
    print("\nseconds a push (chain down H hosts); host GB: one engine's host holds the served weights and the kept")
    print("staging buffer. Anchors: " + "; ".join(ANCHORS))


if __name__ == "__main__":
    main()
