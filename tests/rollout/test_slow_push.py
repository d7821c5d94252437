"""A push that is slow but moves lands: the sidecar's watchdog judges the trainer by what it sends
(weight_sync/trainer/progress_marks.py), never by how fast its own engines take the bytes. The
slowness is real: the engine core is stopped (SIGSTOP, every thread) mid-transfer for longer than
the stall timeout, as a core starved of CPU or busy deriving copies would be."""

import copy
import os
import signal
import threading

import pytest

from engine import SamplingParams
from rollout import RolloutClient
from tests.engine.helpers import hf_greedy
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_sidecar import perturb

pytestmark = pytest.mark.timeout(300)

STALL_S = 2.0
STOPPED_S = 3 * STALL_S  # the receiver reads nothing for this long


def test_a_receiver_stopped_longer_than_the_stall_timeout_still_lands(qwen2_dir, hf_models):
    s = Sidecar(qwen2_dir, "--push-stall-timeout", str(STALL_S))
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync(bucket_bytes=256 * 1024)  # many buckets: the trainer waits on the wire
        trainer = copy.deepcopy(hf_models["qwen2"])
        perturb(trainer, 11)
        core = client.health()["engine_states"][0]["pid"]
        stopped = []

        def stop_the_receiver(k: int, n: int) -> None:  # on the trainer's sending thread, bucket k posted
            if k == 2 and not stopped:
                os.kill(core, signal.SIGSTOP)
                stopped.append(threading.Timer(STOPPED_S, os.kill, (core, signal.SIGCONT)))
                stopped[0].start()

        reply = client.push_weights(trainer, version=1, progress=stop_the_receiver, delta=False)
        assert stopped and reply["trainer"]["seconds"] >= STOPPED_S - 0.5  # the push did wait on the receiver
        stats = client.stats()
        assert stats["version"] == 1 and stats["failed_pushes"] == 0 and stats["engine_restarts"] == 0
        assert client.weights_checksums() == [client.checksum_of(trainer)]
        [[r]] = client.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert r.token_ids == hf_greedy(trainer, [9, 10, 11], 8, True)
    finally:
        for t in stopped:
            t.join()
        client.close()
        s.stop()
