"""Start the real sidecar (`python -m rollout.serve`) as a subprocess for tests."""

import os
import signal
import subprocess
import sys
import time

TOKEN = "test-secret"


class Sidecar:
    def __init__(self, model: str, *extra: str, token: str = TOKEN, timeout: float = 120):
        cmd = [sys.executable, "-m", "rollout.serve", "--model", model, "--port", "0", "--log-level", "WARNING",
               "--max-model-len", "256", "--stats-interval", "0", *extra]
        if token:
            cmd += ["--token", token]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": os.getcwd()})
        deadline = time.monotonic() + timeout
        self.url = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"sidecar exited with {self.proc.wait()} before it was ready")
            if line.startswith("READY "):
                self.url = line.split()[1]
                break
        if self.url is None:
            self.stop()
            raise TimeoutError("sidecar not ready")

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
