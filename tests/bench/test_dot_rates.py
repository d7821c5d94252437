"""bench/dot_rates.py: the probe builds for this CPU and times every multiply instruction it has, each at a
rate a core can retire (more than none, fewer than one every cycle of a 10 GHz core per thread)."""

from __future__ import annotations

from bench import dot_rates
from engine.kernels import native_kernels


def test_the_probe_times_the_instructions_this_cpu_has():
    flags = native_kernels.cpu_flags()
    rates = dot_rates.probe(threads=1, seconds=0.02)
    want = set()
    if {"avx2", "fma"} <= flags:
        want |= {"VFMADD ps ymm (fp32)", "VPMADDWD+VPADDD ymm (int16)"}
    if "avx512_bf16" in flags:
        want.add("VDPBF16PS zmm (bf16)")
    if "avx512_vnni" in flags:
        want |= {"VPDPBUSD zmm (u8 x s8)", "VPDPWSSD zmm (int16)"}
    assert want <= set(rates)
    assert all(0 < r < 4 * 10e9 for r in rates.values())  # up to 4 a cycle at 10 GHz: a sane count
