"""Starting engine-core processes (`python -m engine.core_proc`), cold or from a warm standby.

A standby is a core process started ahead of need: it imports torch, transformers and the
model's code, then waits for its arguments on stdin. `AsyncEngine(cfg, standby=proc)` turns it
into an engine in the time the weights take to load, which is how a supervisor restarts a dead
engine quickly (one idle interpreter's memory, a few hundred MB, while it waits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _core(args: list[str], **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.core_proc", *args],
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}, **popen)


def start_core(core_args: list[str]) -> subprocess.Popen:
    """A core process started cold with its arguments."""
    return _core(core_args)


def spawn_standby(model_dir: str, log_level: str = "WARNING") -> subprocess.Popen:
    """A warm core for `model_dir`, waiting for `hand_over`."""
    return _core(["--standby", model_dir, "--parent-pid", str(os.getpid()), "--log-level", log_level],
                 stdin=subprocess.PIPE, text=True)


def hand_over(standby: subprocess.Popen, core_args: list[str]) -> bool:
    """Give a standby core its arguments; False if it died meanwhile (start a cold one then)."""
    if standby.poll() is not None:
        return False
    try:
        standby.stdin.write(json.dumps(core_args) + "\n")
        standby.stdin.close()
        return True
    except OSError:
        standby.kill()
        return False
