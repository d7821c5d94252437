"""Builds into the shared model cache are atomic (issue 26): torchrun's ranks building the default
model at once both get a whole model, and a killed build leaves nothing taken for one. Builders
are real processes running this file (`python -m tests.engine.test_tiny_model_build`)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.tiny_model import STAMP, build_tiny_model

pytestmark = pytest.mark.timeout(300)
TARGET = "qwen2-tiny"  # default_model_dir()'s name under the cache root


def _start_builder(cache: Path, barrier: Path, n: int) -> subprocess.Popen:
    """A process that waits until `n` builders are ready (files in `barrier`), then builds and loads
    the default model with `$ROLLOUT_CACHE` at `cache`."""
    return subprocess.Popen([sys.executable, "-m", "tests.engine.test_tiny_model_build", str(barrier), str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ROLLOUT_CACHE": str(cache), "PYTHONPATH": os.getcwd()})


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _is_whole(target: Path) -> bool:
    return (target / STAMP).exists()


def test_two_processes_building_the_default_model_at_once_both_get_it_whole(tmp_path):
    cache, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    builders = [_start_builder(cache, barrier, 2) for _ in range(2)]
    target, torn = cache / TARGET, False
    try:
        while any(p.poll() is None for p in builders):  # the target is only ever absent or whole
            torn = torn or (target.exists() and not _is_whole(target))
            time.sleep(0.002)
        results = [_result(p) for p in builders]
    finally:
        for p in builders:
            p.kill()
    assert not torn, "the target directory was seen half-built"
    assert results[0] == results[1] and results[0]["params"] > 0
    assert sorted(os.listdir(cache)) == [f".{TARGET}.lock", TARGET]


def test_a_killed_build_leaves_nothing_a_later_build_takes_for_a_model(tmp_path):
    cache, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    builder = _start_builder(cache, barrier, 1)
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
    later = _start_builder(cache, barrier, 1)
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


def _build_and_load(barrier: Path, n: int) -> dict:
    """A builder's work: meet the others at the barrier, build the default model, load it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.tiny_model import default_model_dir

    (barrier / f"ready-{os.getpid()}").touch()
    while len(list(barrier.iterdir())) < n:
        time.sleep(0.005)
    out = build_tiny_model(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("12 + 30 = 42")) == "12 + 30 = 42"
    with torch.no_grad():
        checksum = sum(float(p.double().sum()) for p in model.parameters())
    return {"params": model.num_parameters(), "checksum": checksum}


if __name__ == "__main__":
    print(json.dumps(_build_and_load(Path(sys.argv[1]), int(sys.argv[2]))))
