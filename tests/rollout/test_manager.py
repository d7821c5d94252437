"""The rollout manager in-process, on a real engine (its core in a real process)."""

import asyncio

import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams
from rollout.sidecar.manager import RolloutManager, _Sample
from tests.engine.helpers import random_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def manager(qwen2_dir, loop):
    engine = AsyncEngine(EngineConfig(model=qwen2_dir, max_model_len=256))
    yield RolloutManager([engine])
    engine.shutdown()


def _straddling_stop(tokenizer, tokens):
    """(k, s): a 4-character stop string s that starts in the text of tokens[:k] and ends after it,
    found nowhere earlier in the completion."""
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    for k in range(4, len(tokens) - 4):
        head = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        s = whole[len(head) - 2:len(head) + 2]
        if whole.startswith(head) and len(s) == 4 and whole.find(s) == len(head) - 2:
            return k, s
    raise AssertionError("no stop string straddles a token boundary")


def test_a_stop_string_straddling_a_resubmission_ends_the_sample_there(manager, loop):
    """A sample cut by an abort pause after k tokens is resubmitted as prompt + k tokens; a stop
    string that starts before the cut and ends after it must end it exactly as it would have
    ended uninterrupted, with text and tokens cut at the same place."""
    prompt = random_prompts(1, 8, 8, 2000, seed=80)[0]
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tokens = loop.run_until_complete(manager.generate_group(prompt, plain))[0].token_ids
    k, stop = _straddling_stop(manager.tokenizer, tokens)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    uninterrupted = loop.run_until_complete(manager.generate_group(prompt, params))[0]
    assert uninterrupted.finish_reason == "stop" and uninterrupted.stop_reason == stop

    sample = _Sample(0)  # what an abort pause after k tokens leaves
    sample.token_ids, sample.logprobs = tokens[:k], uninterrupted.logprobs[:k]
    sample.versions, sample.finish_reason = [0] * k, "abort"
    loop.run_until_complete(manager._complete(prompt, params, sample))
    resumed = manager._to_rollout(prompt, params, sample)
    assert (resumed.finish_reason, resumed.stop_reason) == ("stop", stop)
    assert resumed.token_ids == uninterrupted.token_ids and resumed.text == uninterrupted.text
    assert len(resumed.logprobs) == len(resumed.weight_versions) == len(resumed.token_ids)
    whole = manager.tokenizer.decode(resumed.token_ids, skip_special_tokens=True)
    assert whole.startswith(resumed.text + stop)  # text and tokens end at the same stop


def test_a_sample_too_stale_is_regenerated_at_most_the_cap_then_marked(manager, loop):
    """Versions that move on faster than a sample is generated: each sample is regenerated at
    most max_stale_restarts times, then returned with stale=True and counted."""
    manager.max_staleness, manager.max_stale_restarts = 0, 2
    engine = manager.engines[0]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)

    async def run():
        stop = asyncio.Event()

        async def versions_racing():  # a "push" every few ms: version up, tokens tagged with it
            while not stop.is_set():
                manager.state.committed(manager.version + 1)
                await engine.set_weight_version(manager.version)
                await asyncio.sleep(0.005)

        racer = asyncio.ensure_future(versions_racing())
        try:
            return await asyncio.wait_for(manager.generate_group([5, 6, 7], params), 120)
        finally:
            stop.set()
            await racer

    before = dict(manager.counters)
    try:
        rollouts = loop.run_until_complete(run())
    finally:
        manager.max_staleness = None
    restarts = manager.counters["stale_restarts"] - before["stale_restarts"]
    returned = manager.counters["stale_returned"] - before["stale_returned"]
    assert len(rollouts) == 2 and all(len(r.token_ids) == 24 for r in rollouts)
    assert restarts <= 2 * 2 and returned == sum(r.stale for r in rollouts) >= 1
    assert all(r.weight_versions[0] < r.weight_versions[-1] for r in rollouts if r.stale)


def test_requests_sent_while_asleep_wait_for_wake_up(manager, loop):
    """sleep aborts what runs (the manager resubmits it) and holds what comes after; wake_up
    serves both, whole."""
    engine = manager.engines[0]
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)

    async def run():
        running = asyncio.ensure_future(manager.generate_group([5, 6, 7], params))
        await asyncio.sleep(0.05)
        await engine.sleep(1)
        later = asyncio.ensure_future(manager.generate_group([8, 9], params))
        await asyncio.sleep(0.3)
        held = not running.done() and not later.done()
        await engine.wake_up()
        return held, await running, await later

    before = manager.counters["aborted_resubmitted"]
    held, running, later = loop.run_until_complete(run())
    assert held and len(running[0].token_ids) == 240 and len(later[0].token_ids) == 240
    alone = loop.run_until_complete(manager.generate_group([5, 6, 7], params))
    assert running[0].token_ids == alone[0].token_ids  # greedy: the resubmitted sample is the same
    assert manager.counters["aborted_resubmitted"] > before  # cut by the sleep, then completed
