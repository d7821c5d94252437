"""The libraries vLLM's CPU guide preloads (tcmalloc and Intel OpenMP): where this machine has
them, whether this process runs with them, and the line that sets them. A preload only works
from a process's start, so all the engine can do is say so (`advice`); bench/vllm_cpu_setup.py
restarts a bench under them."""

from __future__ import annotations

import os
import sys

TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                  "/usr/lib/libtcmalloc_minimal.so.4")
NAMES = ("libtcmalloc_minimal", "libiomp5")


def preload_libraries() -> tuple[list[str], list[str]]:
    """(the documented libraries this machine has, what is missing with how to get it)."""
    found, missing = [], []
    tcmalloc = next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)
    if tcmalloc:
        found.append(tcmalloc)
    else:
        missing.append("tcmalloc (apt-get install libtcmalloc-minimal4)")
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(iomp):
        found.append(iomp)
    else:
        missing.append(f"Intel OpenMP at {iomp} (pip install intel-openmp)")
    return found, missing


def preloaded() -> list[str]:
    """The documented libraries this process has mapped (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:  # not Linux
        return []
    return [name for name in NAMES if name in maps]


def advice() -> str | None:
    """None when this process runs with both preloads; else what to export before starting it."""
    if len(preloaded()) == len(NAMES):
        return None
    found, missing = preload_libraries()
    line = f"export LD_PRELOAD={':'.join(found + ['$LD_PRELOAD'])}"
    return line + (f" (missing here: {'; '.join(missing)})" if missing else "")
