"""libc's functions through ctypes, for the kernels that ask the OS about pages (huge_pages) and
for the memory report (which pages are resident)."""

from __future__ import annotations

import ctypes
import functools


def libc_function(name: str, argtypes: tuple):
    """libc's function `name` taking `argtypes` (errno kept), or None where there is none."""
    try:
        f = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    f.argtypes = argtypes
    return f


@functools.cache
def mincore():
    """mincore(address, length, vector) -> 0 or -1: which pages are resident (or None)."""
    return libc_function("mincore", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p))
