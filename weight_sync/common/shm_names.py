"""Names in /dev/shm that say which process owns them, and the sweep of those whose owner died.
No torch here: the sidecar's front end sweeps its host copies before it imports any."""

from __future__ import annotations

import os
import shutil
import uuid

SHM_DIR = "/dev/shm"
SHM_PREFIX = "rollout-weights-"  # a trainer's shared weight buffer (weight_sync/trainer/shared_memory.py)


def owned_name(prefix: str) -> str:
    """A /dev/shm name that says which process owns it, so that `sweep_orphans` can tell when that
    process died without removing it (SIGKILL, OOM): `<prefix><pid>-<random>`."""
    return f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}"


def sweep_orphans(prefixes: tuple[str, ...], shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the /dev/shm files and directories named by `owned_name` whose owner is gone: a
    killed trainer's weight buffer or a killed sidecar's host copy is a whole model of RAM that
    nothing else frees. A pid that is alive (even reused by another process) keeps its entries."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        pid = name[len(prefix):].split("-", 1)[0] if prefix else ""
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(shm_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _remove(path)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


STAGING_PREFIX = "rollout-staging-"  # an engine's staging buffers (weight_sync/engine_side/shared_buffers.py)
