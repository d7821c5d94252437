"""A sidecar's engine (EngineConfig.reserve_push_staging) keeps its weights in a /dev/shm staging
buffer laid out as a push, and its host copy links that buffer instead of writing the weights again
(weight_sync/engine_side/shared_buffers.py, push_dir's raw form): the link is the served bytes, a
second engine loads it exactly, a write of the served weights in place withdraws it first, a copy
whose bytes changed is refused on load, and nothing is left in /dev/shm once the engine is gone.
Real engines, a real group, gloo on loopback."""

import copy
import glob
import os
import pathlib
import shutil
import tempfile

import pytest
import torch

from engine import AsyncEngine, EngineConfig
from weight_sync import EXTENSION, WeightSender, WeightSyncError, weights_checksum
from weight_sync.common.push_dir import MANIFEST_FILE, RAW_FILE, read_manifest
from weight_sync.common.shm_names import SHM_DIR, STAGING_PREFIX, sweep_orphans
from weight_sync.engine_side.engines import engines_checksums, load_on_engines
from weight_sync.trainer.local_engines import init_weight_sync, push_to_engines

pytestmark = pytest.mark.timeout(180)
TIMEOUT_S = 30.0


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, max_num_seqs=4, max_model_len=128, kv_cache_memory_gb=0.05,
                        worker_extension_cls=EXTENSION, reserve_push_staging=True)


def _staging_files(pid: int) -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"{STAGING_PREFIX}{pid}-*"))


@pytest.fixture
def shm_dir():
    """A directory in /dev/shm, where the sidecar keeps its host copy (a link cannot cross filesystems)."""
    path = tempfile.mkdtemp(prefix="rollout-test-host-copy-", dir=SHM_DIR)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pushed(qwen2_dir, hf_models, loop):
    """A sidecar-like engine that took one push of the model, perturbed; its trainer's sender."""
    engine = AsyncEngine(_config(qwen2_dir))
    sender = WeightSender(bucket_bytes=1 << 20, timeout_s=TIMEOUT_S)
    trainer = copy.deepcopy(hf_models["qwen2"])
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.25)
    try:
        loop.run_until_complete(init_weight_sync([engine], sender, timeout_s=TIMEOUT_S))
        loop.run_until_complete(push_to_engines([engine], sender, trainer, version=1, timeout=TIMEOUT_S))
        yield engine, trainer
    finally:
        sender.close_group()
        pid = engine.proc.pid
        engine.shutdown()
        sweep_orphans((STAGING_PREFIX,))  # as the sidecar does once its cores ended (they end with os._exit)
        assert _staging_files(pid) == []


def test_the_host_copy_is_a_link_to_the_served_weights_and_loads_exactly(pushed, qwen2_dir, loop, shm_dir):
    engine, trainer = pushed
    path = str(shm_dir / "v1")
    [out] = loop.run_until_complete(engine.collective_rpc("save_weights", args=(path, 1)))
    assert out["linked"] and read_manifest(path).version == 1
    raw = os.stat(os.path.join(path, RAW_FILE))
    staging = [os.stat(f) for f in _staging_files(engine.proc.pid)]
    assert raw.st_nlink == 2 and any(s.st_ino == raw.st_ino for s in staging)  # the served buffer itself
    other = AsyncEngine(_config(qwen2_dir))
    try:
        loop.run_until_complete(load_on_engines([other], path, 1))
        assert loop.run_until_complete(engines_checksums([other, engine])) == [
            weights_checksum(trainer.named_parameters())] * 2
    finally:
        other.shutdown()


def test_a_host_copy_elsewhere_is_written_as_before(pushed, loop, tmp_path):
    engine, trainer = pushed
    [out] = loop.run_until_complete(engine.collective_rpc("save_weights", args=(str(tmp_path / "v1"), 1)))
    assert not out.get("linked") and out["bytes"] > 0  # /tmp: another filesystem than /dev/shm
    assert read_manifest(tmp_path / "v1").version == 1


def test_a_write_in_place_withdraws_the_link_first(pushed, qwen2_dir, loop, shm_dir):
    engine, _ = pushed
    path = str(shm_dir / "v1")
    loop.run_until_complete(engine.collective_rpc("save_weights", args=(path, 1)))
    loop.run_until_complete(engine.collective_rpc("zero_weights"))  # the served weights written where they lie
    assert not os.path.exists(os.path.join(path, MANIFEST_FILE))  # no push any more
    assert not os.path.exists(os.path.join(path, RAW_FILE))


def test_a_host_copy_whose_bytes_changed_is_refused_and_changes_nothing(pushed, qwen2_dir, loop, shm_dir, tmp_path):
    engine, trainer = pushed
    path = str(shm_dir / "v1")
    loop.run_until_complete(engine.collective_rpc("save_weights", args=(path, 1)))
    torn = tmp_path / "torn"
    torn.mkdir()
    for name in os.listdir(path):  # the same push directory over a copy of the bytes, one of them changed
        data = bytearray((shm_dir / "v1" / name).read_bytes())
        if name == RAW_FILE:
            data[100] ^= 0xFF
        (torn / name).write_bytes(bytes(data))
    other = AsyncEngine(_config(qwen2_dir))
    try:
        before = loop.run_until_complete(engines_checksums([other]))
        with pytest.raises(WeightSyncError, match="changed while they were read"):
            loop.run_until_complete(load_on_engines([other], str(torn), 1))
        assert loop.run_until_complete(engines_checksums([other])) == before
    finally:
        other.shutdown()


def test_the_engine_reports_its_memory_by_part(pushed, loop):
    engine, _ = pushed
    report = loop.run_until_complete(engine.check_health())["memory"]
    assert report["weights"] > 0 and report["kv_cache"] > 0 and report["host_copy_links_weights"]
    # the kept buffer for the next push: the weights' own buffer before the push, freed whole by its commit
    assert report["staging_kept"] >= report["weights"]
    assert 0 <= report["kv_cache_resident"] <= report["kv_cache"]


def test_a_killed_engines_staging_files_are_swept(qwen2_dir, loop):
    engine = AsyncEngine(_config(qwen2_dir))
    pid = engine.proc.pid
    try:
        loop.run_until_complete(engine.check_health())
        files = _staging_files(pid)
        assert files  # its weights' buffer (and the next push's, once made)
        engine.proc.kill()
        engine.proc.wait(10)
        assert set(files) <= set(sweep_orphans((STAGING_PREFIX,)))
        assert _staging_files(pid) == []
    finally:
        engine.shutdown()
