"""Start a local sidecar (`python -m rollout.serve`), or a router over sidecars (`python -m rollout.router`),
as a child process and wait until it serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence


class _ChildServer:
    """A server child process that prints `READY <url>` once it serves (and other `KEY value` lines before);
    `stop()`: SIGTERM, then SIGKILL after `timeout_s`, its own processes too (a vLLM engine's core does not
    watch its parent as ours do, and outlived a killed sidecar)."""

    what = "server"

    def _start(self, cmd: list[str], timeout_s: float, log_path: str | None) -> dict[str, str]:
        """Starts `cmd`, its stderr to `log_path` (default: this process's); its first lines up to READY, by key."""
        log = open(log_path, "a") if log_path else None  # noqa: SIM115 - the child holds it from here on
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])})
        finally:
            if log is not None:
                log.close()
        said: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.what} exited with code {self.proc.wait()} before it was ready (see its log)")
            key, _, value = line.strip().partition(" ")
            said[key] = value.split(" ")[0]
            if key == "READY":
                return said
        self.stop()
        raise TimeoutError(f"{self.what} not ready after {timeout_s:.0f}s")

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                left = descendants(self.proc.pid)
                self.proc.kill()
                self.proc.wait()
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalSidecar(_ChildServer):
    """A sidecar subprocess on a free loopback port; `url` is where to connect. `stop()` sends
    SIGTERM (the sidecar aborts in-flight work, stops its engines and exits 0). The sidecar also
    shuts down by itself when this process exits, however it exits (SIGKILL included).
    `log_path`: a file the sidecar's log is appended to (default: this process's stderr).
    `prefix`: a command the sidecar runs under, e.g. `ip netns exec HOST` (bench.hostbed)."""

    what = "sidecar"

    def __init__(self, model: str, *extra_args: str, token: str = "", timeout_s: float = 300.0,
                 log_path: str | None = None, prefix: Sequence[str] = ()):
        cmd = [*prefix, sys.executable, "-m", "rollout.serve", "--model", model, "--port", "0",
               "--parent-pid", str(os.getpid()), *extra_args]
        if token:
            cmd += ["--token", token]
        self.log_path = log_path
        said = self._start(cmd, timeout_s, log_path)
        self.url: str = said["READY"]
        self.http_url: str | None = said.get("HTTP")  # with --http-port: the OpenAI-compatible front's base URL


class LocalRouter(_ChildServer):
    """A router (`python -m rollout.router`) over sidecars' HTTP fronts, on a free loopback port; `url` is
    its base URL. `stop()` sends SIGTERM (SIGKILL after `timeout_s`); it also exits when this process does."""

    what = "router"

    def __init__(self, sidecar_http_urls: Sequence[str], *extra_args: str, token: str = "",
                 timeout_s: float = 60.0, log_path: str | None = None):
        cmd = [sys.executable, "-m", "rollout.router", "--sidecars", *sidecar_http_urls, "--port", "0",
               "--parent-pid", str(os.getpid()), *extra_args]
        if token:
            cmd += ["--token", token]
        self.url: str = self._start(cmd, timeout_s, log_path)["READY"]


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (Linux's /proc children lists; none elsewhere)."""
    out, frontier = [], [pid]
    while frontier:
        kids = []
        for p in frontier:
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{task}/children") as f:
                        kids += [int(c) for c in f.read().split()]
            except OSError:
                pass
        out += kids
        frontier = kids
    return out
