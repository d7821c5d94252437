"""Per-request seeds derived from the run's `--seed`, so that a run's rollouts depend on the seed
alone: not on how the sidecar happens to batch or order the requests (each seeded request samples
from its own generator in the engine; sample i of n uses seed + i)."""

from __future__ import annotations

import hashlib

MAX_SAMPLES = 1 << 16  # seeds of two prompts never overlap for n up to this


def request_seed(run_seed: int, call: int, prompt_index: int) -> int:
    """The seed of prompt `prompt_index` of generate call `call` (0, 1, ... in the run's order):
    a hash, so nearby runs, calls and prompts get unrelated streams; a multiple of MAX_SAMPLES,
    so the n samples' seeds (seed + i) of different prompts never coincide."""
    digest = hashlib.sha256(f"{run_seed}:{call}:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:5], "big") * MAX_SAMPLES  # < 2**56: fits every generator
