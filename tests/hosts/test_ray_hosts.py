"""Ray across two emulated hosts (bench.hostbed): a Ray head on host ra, a worker node on host rb,
each with its own address and a route out (Ray finds a node's address by routing towards a public
one). The README's "On a Ray cluster" steps, for real: `python -m recipes.grpo --ray --ray-address
... --num-sidecars 2 --placement spread` puts one sidecar on each host and learns, with the
engines' weights checked equal to the trainer's after every push; rb is then lost mid-run (every
process on it SIGKILLed) and brought back, and Ray restarts its sidecar there, which the client
takes back once a peer has sent it the newest weights."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from bench.hostbed import HostBed, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # two Ray nodes and a recipe: about 3 minutes
RAY_PORT = 6399


def _ray_node(bed: HostBed, host: str, temp_dir: str, head: str | None = None) -> subprocess.Popen:
    """A Ray node on `host`: the head (head=None) or a worker joining the head at `head`. One
    logical CPU each: the sidecar of a lost node can only come back where it was."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    args = ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false", "--temp-dir", temp_dir] \
        if head is None else ["--address", f"{head}:{RAY_PORT}"]
    return bed.popen(host, [ray, "start", "--block", *args, "--node-ip-address", bed.addr(host), "--num-cpus", "1",
                            "--disable-usage-stats"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


def _wait_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_grpo_on_ray_across_two_hosts_with_a_host_lost_and_back(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    temp_dir = f"/tmp/rb-ray-{os.getpid()}"  # Ray's sockets need a short path
    try:
        with HostBed(["ra", "rb"], rate_mbit=1000) as bed:
            head = bed.addr("ra")
            _ray_node(bed, "ra", temp_dir)
            _wait_port(head, RAY_PORT, 120)
            _ray_node(bed, "rb", temp_dir, head)
            recipe = bed.popen("ra", [sys.executable, "-m", "recipes.grpo", "--ray", "--ray-address", f"{head}:{RAY_PORT}",
                                      "--num-sidecars", "2", "--placement", "spread", "--max-steps", "24",
                                      "--check-sync", "--output-dir", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "WANDB_MODE": "offline"}, cwd=os.getcwd())
            lines, lost, back = [], False, False
            for line in recipe.stdout:
                lines.append(line)
                if not lost and "pushed version 3:" in line:
                    bed.kill_host("rb")  # its raylet, its sidecar's actor and the sidecar
                    lost = True
                    lost_at = time.monotonic()
                elif lost and not back and time.monotonic() - lost_at > 5:
                    _ray_node(bed, "rb", temp_dir, head)  # the host is back: a new raylet joins
                    back = True
            rc = recipe.wait(60)
        out = "".join(lines)
        assert rc == 0, out[-4000:]
        assert lost and back, out[-4000:]
        assert "2 sidecars on Ray" in out and bed.addr("rb") in out.split("2 sidecars on Ray")[1].splitlines()[0]
        restarted = [ln for ln in lines if "was restarted by Ray" in ln]  # the client took it back...
        assert restarted and f"-> tcp://{bed.addr('rb')}:" in restarted[-1], out[-4000:]  # ...on rb, back
        caught = [ln for ln in lines if " sent sidecar " in ln or "holds version" in ln]  # from its peer
        assert caught, out[-4000:]
        print("".join(restarted + caught))
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
