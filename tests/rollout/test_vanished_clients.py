"""No memory left behind by vanished clients (issue 26, item 3.2): the generate calls of a client
whose process is SIGKILLed mid-request are cancelled (their engine requests aborted) instead of
being generated, and held, for nobody. Real sidecar, real client processes. (Live clients are
probed too: every long generate of the other tests is a live client under probes.)"""

import os
import signal
import subprocess
import sys
import time

import pytest

from engine import SamplingParams
from rollout import RolloutClient
from tests.rollout.sidecar import TOKEN, Sidecar

pytestmark = pytest.mark.timeout(180)

PROCESSES, CLIENTS, N = 2, 10, 8  # 20 clients, one prompt each: 160 sequences
CONTEXT = 1024
MAX_TOKENS = CONTEXT - 8  # 160 x 1016 tokens: far longer to decode on 2 cores than CANCEL_WITHIN_S
CANCEL_WITHIN_S = 10.0  # ten times rollout.server.PROBE_S, how often the clients of calls in flight are probed

# CLIENTS clients in one process, each with a generate call in flight; says "sent", then waits to be killed.
CLIENT_PROCESS = r"""
import asyncio, sys
from engine.sampling_params import SamplingParams
from rollout.client import AsyncRolloutClient
url, token, k, n, max_tokens = sys.argv[1:6]
async def main():
    params = SamplingParams(n=int(n), temperature=1.0, max_tokens=int(max_tokens), ignore_eos=True)
    clients = [AsyncRolloutClient(url, token=token) for _ in range(int(k))]
    calls = [asyncio.ensure_future(c.generate([[5, 6, 7 + i]], params)) for i, c in enumerate(clients)]
    await asyncio.sleep(1.0)  # every call is with the sidecar
    print("sent", flush=True)
    await asyncio.gather(*calls)
asyncio.run(main())
"""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _sidecar_rss(sidecar, client) -> int:
    """Bytes resident in the sidecar process and its engine cores, from /proc."""
    return _rss(sidecar.proc.pid) + sum(_rss(s["pid"]) for s in client.health()["engine_states"])


def _clients(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT_PROCESS, url, TOKEN, str(CLIENTS), str(N), str(MAX_TOKENS)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_clients_killed_mid_generate_leave_no_work_or_memory_behind(qwen2_dir):
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(qwen2_dir, "model.safetensors")).values()
    weights = sum(t.numel() * t.element_size() for t in tensors)  # one copy of the model, the bound on growth
    s = Sidecar(qwen2_dir, "--max-model-len", str(CONTEXT))
    client = RolloutClient(s.url, token=TOKEN)
    procs = []
    try:
        # the same batch, short, from a live client first: the sidecar's memory after it is the baseline
        client.generate([[5, 6, 7 + i] for i in range(PROCESSES * CLIENTS)],
                        SamplingParams(n=N, max_tokens=4, ignore_eos=True))
        start = _sidecar_rss(s, client)
        procs = [_clients(s.url) for _ in range(PROCESSES)]
        for p in procs:
            assert p.stdout.readline().strip() == "sent"
        assert client.stats()["groups_in_flight"] == PROCESSES * CLIENTS
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        deadline = time.monotonic() + CANCEL_WITHIN_S
        while (stats := client.stats())["groups_in_flight"] or stats["queue_depth"]:
            assert time.monotonic() < deadline, (f"{stats['groups_in_flight']} groups, {stats['queue_depth']} "
                                                 "sequences still in flight for clients that are gone")
            time.sleep(0.1)
        grown = _sidecar_rss(s, client) - start
        assert grown < weights, f"the sidecar grew {grown / 2**20:.1f} MiB (the model is {weights / 2**20:.1f} MiB)"
        groups = client.generate([[9, 10, 11]], SamplingParams(n=2, max_tokens=8, ignore_eos=True))
        assert [len(r.token_ids) for r in groups[0]] == [8, 8]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        client.close()
        s.stop()
