"""Runs one documentation snippet the way a reader would: python blocks as a script, bash blocks
under `bash -euo pipefail`, `serves` blocks as sidecars that must come up. Each in its own
process group, killed whatever happens."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from tests.docs.snippets import HTTP_URL, ROOT, SIDECAR_URL, Snippet

TIMEOUT_S = 180


def environment(cache_dir: Path) -> dict[str, str]:
    """The reader's shell: this interpreter's `python` first on PATH, the repository importable,
    models cached under `cache_dir`, wandb offline, one OpenMP thread a process (2 shared cores)."""
    return {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "ROLLOUT_CACHE": str(cache_dir),
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": "1",
    }


def with_addresses(code: str, url: str | None, http_url: str | None) -> str:
    """The snippet's fixed addresses swapped for those of the sidecar the test started."""
    if url:
        code = code.replace(SIDECAR_URL, url)
    if http_url:
        code = code.replace(HTTP_URL, http_url)
    return code


def run(snippet: Snippet, env: dict[str, str], cwd: Path, url: str | None = None,
        http_url: str | None = None) -> subprocess.CompletedProcess:
    code = with_addresses(snippet.full_code(), url, http_url)
    if snippet.lang == "python":
        script = cwd / "snippet.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    # bash runs from the repository's root, as a reader's shell in the clone (its blocks write under
    # /tmp); python from a scratch directory
    return _run_group(cmd, env, cwd if snippet.lang == "python" else ROOT)


def _run_group(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        out += f"\n[timed out after {TIMEOUT_S} s]"
    finally:
        _kill_group(proc)  # whatever the snippet left running in the background
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def serve_commands(code: str) -> list[list[str]]:
    """The `python -m rollout.serve ...` commands of a `serves` block, on free ports."""
    joined = re.sub(r"\\\n\s*", " ", code)
    cmds = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip().removesuffix("&").strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line)
        if argv[:3] != ["python", "-m", "rollout.serve"]:
            raise ValueError(f"a serves block holds only rollout.serve commands, not {line!r}")
        for flag in ("--port", "--http-port"):
            if flag in argv:
                argv[argv.index(flag) + 1] = "0"
        if "--port" not in argv:  # the default 5555 may be another test's sidecar's, running beside this one
            argv += ["--port", "0"]
        cmds.append([sys.executable, *argv[1:], "--parent-pid", str(os.getpid()), "--warm-standby", "off"])
    return cmds


def serve_until_ready(cmd: list[str], env: dict[str, str], timeout_s: float = TIMEOUT_S) -> str:
    """Start the sidecar command, wait for its READY line, stop it; returns its output so far.
    Raises AssertionError when it exits or stays silent instead."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("READY "):
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0, "".join(seen)
                return "".join(seen)
        raise AssertionError(f"{shlex.join(cmd)} never printed READY:\n" + "".join(seen[-40:]))
    finally:
        _kill_group(proc)


@contextmanager
def sidecar(env: dict[str, str], http: bool, args: list[str] = ()):
    """A fresh loopback sidecar of the tiny model (no token), stopped afterwards."""
    from rollout.launcher import LocalSidecar

    saved = dict(os.environ)
    os.environ.update({k: env[k] for k in ("ROLLOUT_CACHE", "OMP_NUM_THREADS")})
    try:
        side = LocalSidecar("tiny", "--log-level", "WARNING", "--max-model-len", "512", "--warm-standby", "off",
                            "--stats-interval", "0", *(["--http-port", "0"] if http else []), *args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield side
    finally:
        side.stop()


def check_python_snippet(snippet: Snippet, env: dict[str, str], cwd: Path) -> None:
    """Run a python block (against a fresh sidecar when it, or the block it continues, asks for
    one); skip it, with its reason, when it is marked as needing what is not here."""
    import pytest

    if snippet.skip_reason:
        pytest.skip(snippet.skip_reason)
    first = snippet
    while "continues" in first.marks and first.previous is not None:  # the sidecar is the first block's
        first = first.previous
    if first.marks & {"sidecar", "http"}:
        with sidecar(env, "http" in first.marks, first.sidecar_args) as side:
            done = run(snippet, env, cwd, side.url, side.http_url)
    else:
        done = run(snippet, env, cwd)
    assert done.returncode == 0, f"{snippet.id} failed ({done.returncode}):\n{done.stdout[-6000:]}"

