"""Pausing the engine core in-process (vLLM's pause_scheduler): abort, wait, keep, held requests."""

import pytest

from engine import EngineConfig, SamplingParams
from engine.core import EngineCore
from tests.engine.helpers import random_prompts


@pytest.fixture(scope="module")
def core(qwen2_dir):
    return EngineCore(EngineConfig(model=qwen2_dir, max_num_seqs=2, max_model_len=128))


def _add(core, ids, budgets, seed):
    for rid, p, n in zip(ids, random_prompts(len(ids), 4, 12, 2000, seed=seed), budgets):
        core.add_request(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))


def _finish_all(core):
    done = {}
    while core.can_step():
        for d in core.step():
            if d.finish_reason:
                done[d.request_id] = d.finish_reason
    return done


def test_wait_finishes_every_earlier_request_queued_ones_too(core):
    _add(core, [f"w{i}" for i in range(6)], [3, 9, 5, 7, 4, 6], seed=70)
    core.step()  # two of six started, four still queued behind max_num_seqs=2
    assert len(core.scheduler.running) == 2 and len(core.scheduler.waiting) == 4
    core.pause("wait")
    assert not core.drained() and core.is_paused
    _add(core, ["late"], [3], seed=71)  # after the pause: held until resume
    done = _finish_all(core)
    assert done == {f"w{i}": "length" for i in range(6)}
    assert core.drained() and not core.can_step()
    assert set(core.requests) == {"late"}
    core.resume()
    assert _finish_all(core) == {"late": "length"} and not core.is_paused
    assert core.block_manager.num_free_blocks == core.runner.num_blocks


def test_wait_with_nothing_in_flight_is_paused_at_once(core):
    core.pause("wait")
    assert core.drained() and core.is_paused
    core.resume()


def test_keep_freezes_and_abort_ends_what_runs_but_not_what_is_held(core):
    _add(core, ["k0", "k1", "k2"], [20, 20, 20], seed=72)
    core.step()
    core.step()
    core.pause("keep")
    assert core.drained() and not core.can_step() and core.step() == []
    _add(core, ["held"], [3], seed=73)
    deltas = core.pause("abort")  # k0, k1 running, k2 queued: all end; "held" stays held
    assert sorted(d.request_id for d in deltas) == ["k0", "k1", "k2"]
    assert all(d.finish_reason == "abort" for d in deltas)
    assert set(core.requests) == {"held"}
    core.resume()
    assert _finish_all(core) == {"held": "length"}


def test_aborting_a_held_request(core):
    core.pause("keep")
    _add(core, ["h"], [3], seed=74)
    assert [(d.request_id, d.finish_reason) for d in core.abort_requests(["h"])] == [("h", "abort")]
    core.resume()
    assert not core.can_step() and core.requests == {}


def test_bad_pause_mode(core):
    with pytest.raises(ValueError, match="pause mode"):
        core.pause("later")
    assert not core.is_paused
