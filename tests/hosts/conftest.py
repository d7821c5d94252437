"""The test bed of hosts (bench.hostbed): sidecars on emulated hosts behind shaped links, the
trainer (the test process) on the bridge. Skipped, saying why, where namespaces cannot be made."""

import concurrent.futures

import pytest

from bench.hostbed import HostBed, unavailable
from tests.rollout.sidecar import TOKEN

HOSTS = ("h1", "h2", "h3")
RATE_MBIT = 100  # the tiny model's 14.7 MB push: 1.2 s over one link
SIDECAR_ARGS = ("--log-level", "WARNING", "--max-model-len", "256", "--stats-interval", "0", "--warm-standby", "off")


@pytest.fixture(scope="module")
def bed():
    why = unavailable()
    if why:
        pytest.skip(why)
    with HostBed(HOSTS, rate_mbit=RATE_MBIT) as b:
        yield b


@pytest.fixture(scope="module")
def host_sidecars(bed, qwen2_dir):
    """One sidecar on each host, bound to its address, started side by side."""
    with concurrent.futures.ThreadPoolExecutor(len(HOSTS)) as pool:
        started = {h: pool.submit(bed.sidecar, h, qwen2_dir, *SIDECAR_ARGS, token=TOKEN) for h in HOSTS}
        concurrent.futures.wait(started.values())
    try:
        yield {h: f.result() for h, f in started.items()}
    finally:
        for f in started.values():
            if f.exception() is None:
                f.result().stop()
