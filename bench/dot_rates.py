"""How fast this CPU multiplies, per instruction kind: a step bound by its products can run no faster
than its multiply instructions retire, so which 8-bit scheme could pay where bf16's products bound a
step (issue 63 item 3) is read off here. Each kind runs 12 independent accumulators in registers on every
thread at once (bench/native/dot_rates.c, compiled for this CPU as the engine's kernels are); printed: the
instructions retired a second over all threads, the products they do (a 512-bit VDPBF16PS does 32 bf16
products, VPDPBUSD 64 u8 x s8, VPDPWSSD 32 int16, VFMADD 16 fp32; 256-bit VPMADDWD 16 int16 with its
VPADDD), and each kind's products against the bf16 dot product's (fp32 FMA's where there is none).

    python -m bench.dot_rates
    python -m bench.dot_rates --threads 1 --seconds 0.5
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import time

import torch  # noqa: F401 - its libgomp must be the loaded one before the probe asks for libgomp.so.1

from engine.kernels import native_kernels

log = logging.getLogger("bench.dot_rates")

SOURCE_DIR = os.path.join(os.path.dirname(__file__), "native")
KINDS = [  # in dot_rates.c's order: (name, products an instruction)
    ("VFMADD ps zmm (fp32)", 16), ("VDPBF16PS zmm (bf16)", 32), ("VPDPBUSD zmm (u8 x s8)", 64),
    ("VPDPWSSD zmm (int16)", 32), ("VFMADD ps ymm (fp32)", 8), ("VPMADDWD+VPADDD ymm (int16)", 16)]


def probe(threads: int, seconds: float) -> dict[str, float]:
    """Instructions a second of each kind this CPU has, `threads` threads at once (best of three runs,
    each sized to take about `seconds`)."""
    lib = ctypes.CDLL(native_kernels._build("dot_rates", SOURCE_DIR))
    lib.dot_rates_kinds.restype = ctypes.c_int
    lib.dot_rates_run.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.dot_rates_run.restype = ctypes.c_double
    have = lib.dot_rates_kinds()
    rates = {}
    for kind, (name, _) in enumerate(KINDS):
        if not have >> kind & 1:
            continue
        t0 = time.perf_counter()
        first = lib.dot_rates_run(kind, 1_000_000, threads)  # a calibration: ~12 M instructions a thread
        n = max(1, int(1_000_000 * seconds / max(time.perf_counter() - t0, 1e-6)))
        rates[name] = max([first] + [lib.dot_rates_run(kind, n, threads) for _ in range(3)])
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads at once (default: every core)")
    ap.add_argument("--seconds", type=float, default=1.0, help="about how long each timed run takes")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rates = probe(args.threads, args.seconds)
    per = dict(KINDS)
    anchor = next((k for k in ("VDPBF16PS zmm (bf16)", "VFMADD ps ymm (fp32)") if k in rates), None)
    log.info("%d threads: %-30s %14s %16s %s", args.threads, "instruction", "G instr/s", "G products/s",
             f"products vs {anchor}")
    for name, rate in rates.items():
        ratio = rate * per[name] / (rates[anchor] * per[anchor]) if anchor else float("nan")
        log.info("%-41s %14.2f %16.1f %10.2fx", name, rate / 1e9, rate * per[name] / 1e9, ratio)


if __name__ == "__main__":
    main()
