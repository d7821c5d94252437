"""Pushes with no process group, through memory shared on one machine (/dev/shm on the CPU; the
same code takes a CUDA IPC handle on a GPU): same validation, nothing half-applied."""

import os

import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from tests.engine.helpers import hf_greedy
from weight_sync import EXTENSION, WeightSender, flatten_parameters
from weight_sync.engine_side.engines import engines_checksums
from weight_sync.trainer.local_engines import push_shared_to_engines

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(qwen2_dir, loop):
    e = AsyncEngine(EngineConfig(model=qwen2_dir, max_model_len=256, kv_cache_memory_gb=0.1,
                                 worker_extension_cls=EXTENSION))
    yield e
    e.shutdown()


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


async def _greedy(engine, prompt):
    out = None
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)):
        pass
    return out.outputs[0]


def test_a_shared_memory_push_reaches_the_engine_exactly(engine, hf_models, loop):
    trainer = type(hf_models["qwen2"]).from_pretrained(hf_models["qwen2"].name_or_path, dtype=torch.float32)
    flat = flatten_parameters(trainer, shared=True)
    sender = WeightSender()  # builds the manifest only: no group
    for version in (1, 2):  # the trainer writes in place between pushes, as an optimizer does
        _perturb(trainer, version)
        out = loop.run_until_complete(push_shared_to_engines([engine], sender, trainer, version, pause_mode="keep"))
        assert out["worker_results"][0]["transport"] == "shared (shm)"
        assert loop.run_until_complete(engines_checksums([engine])) == [sender.checksum(trainer)]
        got = loop.run_until_complete(_greedy(engine, [9, 10, 11]))
        assert got.token_ids == hf_greedy(trainer, [9, 10, 11], 8, ignore_eos=True)
        assert got.weight_versions == [version] * 8
    assert flat.numel() >= sum(p.numel() * 4 for p in trainer.parameters())


def test_weights_not_in_shared_memory_are_refused_before_anything_is_sent(engine, hf_models, loop):
    before = loop.run_until_complete(engines_checksums([engine]))
    for shared in (None, False):  # not flattened at all; flattened into private memory
        trainer = type(hf_models["qwen2"]).from_pretrained(hf_models["qwen2"].name_or_path, dtype=torch.float32)
        if shared is not None:
            flatten_parameters(trainer, shared=shared)
        with pytest.raises(ValueError, match="flatten_parameters\\(model, shared=True\\)"):
            loop.run_until_complete(push_shared_to_engines([engine], WeightSender(), trainer, 9))
    assert loop.run_until_complete(engines_checksums([engine])) == before


def test_a_forged_or_short_handle_is_refused_and_changes_nothing(engine, hf_models, loop, tmp_path):
    trainer = type(hf_models["qwen2"]).from_pretrained(hf_models["qwen2"].name_or_path, dtype=torch.float32)
    flatten_parameters(trainer, shared=True)
    sender = WeightSender()
    prepared = sender.prepare(trainer, 7)
    from weight_sync.trainer.shared_memory import export_weights

    handle = export_weights(prepared.manifest, prepared.named)
    before = loop.run_until_complete(engines_checksums([engine]))
    secret = tmp_path / "not-weights"
    secret.write_bytes(b"x" * 64)
    for bad, match in (({**handle, "path": str(secret)}, "not a shared weight buffer"),
                       ({**handle, "path": "/dev/shm/../etc/passwd"}, "not a shared weight buffer"),
                       ({**handle, "size": handle["size"] * 2}, "claims"),
                       ({**handle, "kind": "tcp"}, "unknown shared-memory kind")):
        with pytest.raises(ValueError, match=match):
            loop.run_until_complete(engine.collective_rpc("receive_weights_shared",
                                                          args=(prepared.manifest.to_wire(), bad)))
    assert loop.run_until_complete(engines_checksums([engine])) == before
    assert os.path.exists(handle["path"])  # the trainer's buffer is untouched and still there


def test_a_killed_owners_shared_memory_is_swept_and_a_live_owners_is_kept(tmp_path):
    """A trainer or sidecar SIGKILLed holding a /dev/shm buffer cannot free it: the next process to
    make one sweeps every entry whose owner pid is gone (a whole model of RAM each)."""
    import signal
    import subprocess
    import sys

    from weight_sync.common.shm_names import owned_name, sweep_orphans

    make = ("import os, sys; from weight_sync.common.shm_names import owned_name; d = sys.argv[1]; "
            "f = os.path.join(d, owned_name('t-file-')); open(f, 'wb').write(b'x'); "
            "os.mkdir(os.path.join(d, owned_name('t-dir-'))); print('made', flush=True); sys.stdin.read()")
    procs = [subprocess.Popen([sys.executable, "-c", make, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
             for _ in range(2)]
    for p in procs:
        assert p.stdout.readline() == "made\n"
    killed, alive = procs
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    mine = tmp_path / owned_name("t-file-")
    mine.write_bytes(b"y")
    other = tmp_path / "t-file-notapid"  # not named by owned_name: never touched
    other.write_bytes(b"z")
    try:
        removed = sweep_orphans(("t-file-", "t-dir-"), str(tmp_path))
        assert sorted(os.path.basename(r).split("-")[2] for r in removed) == [str(killed.pid)] * 2
        left = sorted(os.listdir(tmp_path))
        assert len(left) == 4 and all(str(killed.pid) not in n for n in left), left
        assert mine.exists() and other.exists()
    finally:
        alive.kill()
        alive.wait()


def test_a_cuda_handle_names_its_gpu_by_uuid_not_by_index():
    """Processes with different CUDA_VISIBLE_DEVICES number one GPU differently: the engine
    opens the trainer's buffer on its own index of the trainer's GPU, or refuses by name."""
    from weight_sync.engine_side.staging_sources import local_cuda_index

    assert local_cuda_index("GPU-b", ["GPU-a", "GPU-b"]) == 1
    assert local_cuda_index("GPU-b", ["GPU-b"]) == 0
    with pytest.raises(ValueError, match=r"the trainer's GPU \(GPU-c\) is not one this engine sees"):
        local_cuda_index("GPU-c", ["GPU-a", "GPU-b"])
