"""Whether a sidecar's weights are still moving onto 2 MB pages (engine/kernels/huge_pages.py), from its
health replies: a bench measures the steady state, after the move (minutes at 1.7B on a VM whose
host backs each fresh 2 MB page only then, every step slower meanwhile), as a long run serves."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def weights_moving(health: list[dict] | dict) -> bool:
    """Whether any engine of these health replies (one sidecar's, or a list) says its weights move."""
    replies = health if isinstance(health, list) else [health]
    return any(s.get("memory", {}).get("huge_pages_moving") for h in replies for s in h.get("engine_states", []))


def wait_settled(health, limit: float = 600.0) -> float:
    """Poll `health()` until no weights move (at most `limit` s); returns the seconds waited."""
    t0 = time.perf_counter()
    while weights_moving(health()):
        if time.perf_counter() - t0 > limit:
            log.warning("the weights were still moving onto 2 MB pages after %.0f s: measuring anyway", limit)
            break
        time.sleep(2.0)
    return time.perf_counter() - t0
