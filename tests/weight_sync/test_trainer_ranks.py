"""A trainer of two ranks (gloo) pushes to a real sidecar: rank 0 through the client, rank 1
following its gathers; the engine ends up with the full model's exact checksum."""

import json
import os
import subprocess
import sys

import pytest

from tests.procs import free_port
from tests.rollout.sidecar import TOKEN, Sidecar

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    s = Sidecar(qwen2_dir)
    yield s
    s.stop()


@pytest.mark.parametrize("wrap,version", [("ddp", 1), ("fsdp2", 2)])
def test_a_two_rank_trainer_pushes_the_full_model(sidecar, qwen2_dir, wrap, version):
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.weight_sync.ranks_proc", "--url", sidecar.url, "--token",
                               TOKEN, "--model", qwen2_dir, "--rank", str(r), "--port", str(port), "--wrap", wrap,
                               "--version", str(version)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
             for r in (0, 1)]
    try:
        outs = [json.loads(p.communicate(timeout=240)[0].strip().splitlines()[-1]) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    lead, follower = outs
    assert lead["want"] == lead["plain"] and lead["got"] == [lead["plain"]]
    # DDP: nothing sharded, yet the follower hears of each pass; FSDP2: it gathers in each
    assert follower["passes"] == [1, 1]
    assert lead["group_ok"] and follower["group_ok"]
