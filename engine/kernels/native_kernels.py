"""The engine's C kernels (engine/kernels/native/*.c), compiled for this CPU at first use and loaded with
ctypes: no torch headers (a compile takes about a second, not the minutes of a torch extension),
no pickle, nothing but raw pointers and sizes across the call.

A build is cached by the hash of its source (and the shared headers), the compiler's version, the flags and this CPU's
feature flags (`-march=native` code must not run on another CPU sharing the cache), under
$ROLLOUT_KERNEL_CACHE, else $XDG_CACHE_HOME/rollout-sidecar/kernels, else a temp dir. Processes
starting together each compile into a file of their own and rename it into place: the same
bytes either way. No C compiler, a failed build, or ROLLOUT_NATIVE_KERNELS=0 leaves the engine on
its torch path, with one warning saying why.

The compiled code uses OpenMP; its DT_NEEDED libgomp.so.1 resolves to the one torch loaded
already (or to Intel OpenMP preloaded in its place), so its threads are torch's threads.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

log = logging.getLogger(__name__)

SOURCE_DIR = os.path.join(os.path.dirname(__file__), "native")
# -ffp-contract=fast: a * b + c as one FMA (these kernels reproduce no one's bits; -std=c11 alone turns it off)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast"]
EXTRA_FLAGS = {"layer_glue": ["-ffp-contract=off"],  # its rotation reproduces torch's bits: no FMA
               "lora_merge": ["-ffp-contract=off"],  # a scale then an add, each rounded as torch's ops round
               # the tile instructions build on any x86-64 gcc; amx_linears calls them only where the CPU has them
               "amx_linear": ["-mamx-tile", "-mamx-int8", "-mamx-bf16"]}
ENV_SWITCH = "ROLLOUT_NATIVE_KERNELS"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "off", "false", "no")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _cache_dir() -> str:
    base = os.environ.get("ROLLOUT_KERNEL_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "rollout-sidecar", "kernels")
    try:
        os.makedirs(base, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    fallback = os.path.join(tempfile.gettempdir(), f"rollout-kernels-{os.getuid()}")
    os.makedirs(fallback, exist_ok=True)
    return fallback


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo's; empty where it cannot be read)."""
    return set(_cpu_flags().split()[2:])


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)


def _build(name: str, source_dir: str = SOURCE_DIR) -> str:
    """The path of `name`.c (in `source_dir`: the engine's kernels, or a bench's probe) compiled for this
    CPU (built now unless cached). Raises on failure."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    src = os.path.join(source_dir, f"{name}.c")
    code = b""
    for path in [src, *sorted(glob.glob(os.path.join(source_dir, "*.h")))]:  # a header's change rebuilds too
        with open(path, "rb") as f:
            code += f.read()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = FLAGS + EXTRA_FLAGS.get(name, [])
    key = hashlib.sha256(b"\0".join([code, version.encode(), " ".join(flags).encode(), _cpu_flags().encode()]))
    path = os.path.join(_cache_dir(), f"{name}-{key.hexdigest()[:16]}.so")
    if os.path.isfile(path):
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, src, "-lm"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {name}.c: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: a process loading it meanwhile sees the old file or the whole new one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("compiled %s for this CPU: %s", name, path)
    return path


@functools.cache
def library(name: str) -> ctypes.CDLL | None:
    """The loaded kernel library, or None (the caller keeps its torch path) with one warning."""
    if not enabled():
        log.info("native kernels off (%s=%s): %s runs on torch", ENV_SWITCH, os.environ.get(ENV_SWITCH), name)
        return None
    try:
        import torch  # noqa: F401 - its libgomp must be the loaded one before ours asks for libgomp.so.1

        return ctypes.CDLL(_build(name))
    except Exception as e:  # noqa: BLE001 - any failure means the torch path, said once
        log.warning("native kernel %s unavailable (%s): using the torch path", name, e)
        return None


@functools.cache
def function(name: str, symbol: str, argtypes: tuple, restype=None):
    """`symbol` of the kernel library `name`, with its C signature; None where the library is not."""
    lib = library(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


_dependents: list = []  # what other modules decided from the libraries (their probes): cleared with them


def forget_with_kernels(clear) -> None:
    """Call `clear()` at every `reset` (a module's cached probe of whether its kernel runs)."""
    _dependents.append(clear)


def reset() -> None:
    """Forget what was loaded (tests that change the environment the kernels are built under), and
    every probe made from it."""
    library.cache_clear()
    function.cache_clear()
    for clear in _dependents:
        clear()
