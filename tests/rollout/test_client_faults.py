"""The client never hangs (issue 18): its timeout fires when the sidecar dies mid-call, and a client
dropped without close() never blocks garbage collection."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from engine import SamplingParams
from rollout import RolloutClient, SidecarError
from tests.procs import descendants
from tests.rollout.sidecar import TOKEN, Sidecar

pytestmark = pytest.mark.timeout(180)


def _kill_after(proc, seconds):
    threading.Timer(seconds, lambda: os.kill(proc.pid, signal.SIGKILL)).start()


def test_generate_raises_at_once_when_the_sidecar_is_killed(qwen2_dir):
    sidecar = Sidecar(qwen2_dir)
    client = RolloutClient(sidecar.url, token=TOKEN, timeout_s=60)
    try:
        client.health()
        params = SamplingParams(n=4, max_tokens=200, ignore_eos=True)
        _kill_after(sidecar.proc, 1.0)
        t0 = time.monotonic()
        with pytest.raises(SidecarError, match="no sidecar left") as e:
            client.generate([[5, 6, 7]] * 64, params)
        assert e.value.kind == "gone"
        assert time.monotonic() - t0 < 1.0 + 5  # its connection closed: noticed long before the 60 s timeout
        with pytest.raises(SidecarError, match="no sidecar left"):  # and the next call too, not a hang
            client.health()
    finally:
        client.close()
        sidecar.stop()


def test_generate_iter_raises_at_once_when_the_sidecar_is_killed(qwen2_dir):
    sidecar = Sidecar(qwen2_dir)
    client = RolloutClient(sidecar.url, token=TOKEN, timeout_s=60)
    try:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        it = client.generate_iter([[5, 6, 7]] * 64, params)
        _kill_after(sidecar.proc, 1.0)
        t0 = time.monotonic()
        with pytest.raises(SidecarError, match="no sidecar left"):
            for _ in it:
                pass
        assert time.monotonic() - t0 < 1.0 + 5
    finally:
        client.close()
        sidecar.stop()


def test_a_frozen_sidecar_costs_the_timeout_not_a_hang(qwen2_dir):
    """SIGSTOP: the connection stays up and nothing answers; the call's timeout fires."""
    sidecar = Sidecar(qwen2_dir)
    client = RolloutClient(sidecar.url, token=TOKEN, timeout_s=4)
    try:
        client.health()
        os.kill(sidecar.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer"):
            client.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=50, ignore_eos=True))
        assert time.monotonic() - t0 < 4 + 5
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
        client.close()
        sidecar.stop()


DROP = textwrap.dedent("""
    import gc, sys, time
    from rollout import RolloutClient, SidecarError
    client = RolloutClient(sys.argv[1], token=sys.argv[2])
    client.health()  # the readers run now: their sockets are open
    {drop}
    t0 = time.monotonic()
    gc.collect()
    print(f"collected in {{time.monotonic() - t0:.3f}}s", flush=True)
""")


def test_a_client_dropped_without_close_never_blocks(qwen2_dir):
    """An exception that skips close() in a training script must not freeze the trainer, neither
    at the next garbage collection nor at interpreter exit."""
    sidecar = Sidecar(qwen2_dir)
    try:
        for drop, code in [("del client", 0), ("raise RuntimeError('a training step failed')", 1)]:
            proc = subprocess.run([sys.executable, "-c", DROP.format(drop=drop), sidecar.url, TOKEN],
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == code, (drop, proc.stderr[-2000:])
            assert ("collected in" in proc.stdout) == (code == 0), drop
    finally:
        sidecar.stop()


def test_a_killed_trainer_takes_its_own_sidecar_with_it(qwen2_dir, tmp_path):
    """A trainer that started its sidecar with LocalSidecar and is then killed (SIGTERM from a
    scheduler, SIGKILL from the OOM killer) leaves no sidecar or engine behind."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, time\n"
        "from rollout.launcher import LocalSidecar\n"
        f"s = LocalSidecar({qwen2_dir!r}, '--log-level', 'WARNING', '--stats-interval', '0')\n"
        "print('UP', s.proc.pid, flush=True)\n"
        "time.sleep(600)\n")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": os.getcwd()})
        line = trainer.stdout.readline()
        assert line.startswith("UP"), line
        sidecar_pid = int(line.split()[1])
        family = [sidecar_pid, *descendants(sidecar_pid)]
        assert len(family) >= 2  # the sidecar and its engine core
        trainer.send_signal(sig)
        trainer.wait(10)
        deadline = time.monotonic() + 60  # a bound for a loaded machine; idle, it is about a second
        while alive := [p for p in family if _running(p)]:
            assert time.monotonic() < deadline, f"{alive} outlived their trainer ({sig.name})"
            time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
