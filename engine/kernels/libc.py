"""libc's functions through ctypes, for the kernels that ask the OS about pages (huge_pages), for the
memory report (which pages are resident) and for a commit that freed copies (malloc_trim)."""

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


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; ~1 ms): the derived copies a commit
    replaced were held beside the new ones until then, and glibc keeps freed chunks of that size in
    its heap (its mmap threshold rises with the first large free), so without this the engine's RSS
    kept a second set of copies after each push. A no-op off glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    return libc_function("malloc_trim", (ctypes.c_size_t,))
