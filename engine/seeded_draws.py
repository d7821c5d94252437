"""Seeded draws: a request's seed folded into a stream key, and one uniform per (key, position) as
a pure hash (no generator state). Python ints and numpy only, so that the sidecar's front end,
which keys each sequence, imports no torch."""

from __future__ import annotations

import numpy as np

_M32 = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)  # odd, below 2^31: no int64 product overflows


def mix32(x):
    """A 32-bit integer hash (xor-shift-multiply rounds, a bijection of [0, 2^32)) of a Python
    int or an int64 numpy array holding values in [0, 2^32)."""
    for mult, shift in zip(_MULTIPLIERS, (16, 15, 12)):
        x = ((x ^ (x >> shift)) * mult) & _M32
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """A 64-bit seed folded into the 32-bit key of its stream (computed once per sequence)."""
    seed %= 2**64
    return mix32((seed & _M32) ^ mix32(seed >> 32))


def counter_uniforms(key: np.ndarray, position: np.ndarray) -> np.ndarray:
    """One uniform in (0, 1] per row (float64), a pure function of (seed key, position): int64
    arrays with values in [0, 2^32), the key from `seed_key`, the position the index of the
    token being sampled. Counter-based (a hash, not a generator's state), so a seeded row needs
    no generator of its own and its draw does not depend on the batch, the device or how the
    engine was restarted; computed on the host, where it costs microseconds for the whole
    batch and no device op, and sent with the step's other sampling inputs. 53 bits, as fine
    as a float64 uniform gets. The position is mixed before the key joins, so two keys never
    give shifted copies of one stream."""
    h = mix32(key ^ mix32(position & _M32))
    hi = h >> 6  # 26 bits
    lo = mix32(h ^ 0x5BD1E995) >> 5  # 27 more
    return ((hi << 27) + lo + 1).astype(np.float64) * 2.0**-53
