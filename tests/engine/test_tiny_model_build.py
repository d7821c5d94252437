"""Builds into the shared model cache are atomic (issue 26): torchrun's ranks building the default
model at once both get it whole, and a killed build leaves nothing taken for one. Builders are
real processes running this file (`python -m tests.engine.test_tiny_model_build`)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.models.tiny_model import STAMP, build_tiny_model, build_tiny_models
from tests.procs import free_port

pytestmark = pytest.mark.timeout(300)
TARGET = "qwen2-tiny"  # default_model_dir()'s name under the cache root


def _start_builder(cache: Path, *rank_and_port: int) -> subprocess.Popen:
    """A process that builds and loads the default model with `$ROLLOUT_CACHE` at `cache`: alone,
    or as a rank of a two-rank gloo group (as under torchrun)."""
    return subprocess.Popen([sys.executable, "-m", "tests.engine.test_tiny_model_build", *map(str, rank_and_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ROLLOUT_CACHE": str(cache), "PYTHONPATH": os.getcwd()})


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _is_whole(target: Path) -> bool:
    return (target / STAMP).exists()


def test_two_ranks_building_the_default_model_at_once_both_get_it_whole(tmp_path):
    """Rank 1 starts the build (transformers 5 saves weights from rank 0 only); rank 0 asks for
    the model while that build is under way."""
    cache, port = tmp_path / "cache", free_port()
    ranks = [_start_builder(cache, rank, port) for rank in (0, 1)]
    target, torn = cache / TARGET, False
    try:
        while any(p.poll() is None for p in ranks):  # the target is only ever absent or whole
            torn = torn or (target.exists() and not _is_whole(target))
            time.sleep(0.002)
        results = [_result(p) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert not torn, "the target directory was seen half-built"
    assert results[0] == results[1] and results[0]["params"] > 0
    assert sorted(os.listdir(cache)) == [f".{TARGET}.lock", TARGET]


def test_a_killed_build_leaves_nothing_a_later_build_takes_for_a_model(tmp_path):
    cache = tmp_path / "cache"
    builder = _start_builder(cache)
    try:
        while not any(cache.rglob("config.json")):  # kill it mid-write
            assert builder.poll() is None, builder.communicate()[1][-3000:]
            time.sleep(0.002)
        os.kill(builder.pid, signal.SIGKILL)
        builder.wait()
    finally:
        builder.kill()
    assert builder.returncode == -signal.SIGKILL  # killed, not finished
    target = cache / TARGET
    assert not target.exists() or _is_whole(target)
    later = _start_builder(cache)
    try:
        assert _result(later)["params"] > 0
    finally:
        later.kill()
    assert sorted(os.listdir(cache)) == [f".{TARGET}.lock", TARGET]  # the killed build's leftovers went


def test_a_directory_that_is_not_a_build_is_refused_not_deleted(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a tiny-model build"):
        build_tiny_model(mine)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_families_built_by_one_process_are_the_bytes_each_built_alone_gives(tmp_path, tiny_dirs):
    """`build_tiny_models` (the suite's `tiny_dirs`: every family by one process) writes what
    `build_tiny_model` writes for each family in a process of its own: the same seeded weights."""
    alone = build_tiny_model(tmp_path / "llama3", "tiny", "llama3")
    together = Path(tiny_dirs["llama3"])
    assert sorted(os.listdir(alone)) == sorted(os.listdir(together))
    for name in os.listdir(alone):
        assert (alone / name).read_bytes() == (together / name).read_bytes(), name


def test_an_unknown_family_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'gpt9'"):
        build_tiny_models({"qwen2": tmp_path / "a", "gpt9": tmp_path / "b"})
    assert not any(tmp_path.iterdir())


def _build_started(cache: Path) -> bool:
    return cache.is_dir() and any((cache / name).is_dir() for name in os.listdir(cache))


def _build_and_load(rank: int | None = None, port: int | None = None) -> dict:
    """A builder's work: join the group if it has a rank, build the default model, load it."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.tiny_model import cache_root, default_model_dir

    if rank is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    while rank == 0 and not _build_started(cache_root()):
        time.sleep(0.005)
    out = build_tiny_model(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("12 + 30 = 42")) == "12 + 30 = 42"
    with torch.no_grad():
        checksum = sum(float(p.double().sum()) for p in model.parameters())
    if rank is not None:
        dist.destroy_process_group()
    return {"params": model.num_parameters(), "checksum": checksum}


if __name__ == "__main__":
    print(json.dumps(_build_and_load(*map(int, sys.argv[1:]))))
