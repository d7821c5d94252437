"""Multi-turn episodes against a real sidecar (tiny Qwen2, fp32), through `AsyncRolloutClient` and
through the OpenAI front with the official `openai` client: the trainer's fp32 forward over each
stitched episode gives the engine's logprob on every policy token, across turns and across a weight
push that lands mid-episode in keep mode; the staleness bound restarts episodes; an environment that
raises ends only its own episode."""

import logging
import threading

import pytest
import torch

from recipes.envs import env_factory
from recipes.episode_metrics import episode_metrics
from recipes.episodes import Settings, run_episodes
from recipes.turns import client_turns, openai_turns
from rollout import RolloutClient
from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_engine_faults import _perturbed

pytestmark = pytest.mark.timeout(300)

TURNS, MAX_TOKENS = 3, 12


@pytest.fixture(scope="module")
def sidecar(qwen2_dir):
    s = Sidecar(qwen2_dir, "--http-port", "0", "--max-model-len", "512")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(qwen2_tokenizer):
    return qwen2_tokenizer


@pytest.fixture(scope="module")
def zmq(sidecar, hf_models):
    """The trainer's client; the sidecar serves the tiny model's own weights at the start of each test."""
    c = RolloutClient(sidecar.url, token=TOKEN)
    c.init_weight_sync()
    yield c
    c.close()


def _serve(zmq, model) -> int:
    version = zmq.stats()["version"] + 1
    zmq.push_weights(model, version=version)
    return version


def _play(thread, make_env, n: int, settings: Settings, seed0: int = 0):
    seeds = [seed0 + i // 2 for i in range(n)]  # groups of two share an environment seed
    return thread.submit(run_episodes, make_env, seeds, [1000 * seed0 + 17 * i for i in range(n)], settings)


def _policy_logprobs(model, ep) -> torch.Tensor:
    """The trainer's fp32 logprob of each token after the episode's first prompt."""
    ids = torch.tensor([ep.prompt_token_ids + ep.token_ids])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    p = len(ep.prompt_token_ids)
    lp = torch.log_softmax(logits[p - 1: p - 1 + len(ep.token_ids)], dim=-1)
    return lp.gather(-1, torch.tensor(ep.token_ids).unsqueeze(-1)).squeeze(-1)


def _tolerance(model, episodes) -> float:
    longest = max(episodes, key=lambda e: len(e.prompt_token_ids) + len(e.token_ids))
    return fp32_logprob_tolerance(model.config, activation_magnitude(model, longest.prompt_token_ids + longest.token_ids))


@pytest.mark.parametrize("transport", ["client", "openai"])
def test_episodes_are_token_exact_through_either_transport(sidecar, zmq, tokenizer, hf_models, transport):
    model = hf_models["qwen2"]
    version = _serve(zmq, model)
    thread = (client_turns(sidecar.url, TOKEN, tokenizer) if transport == "client"
              else openai_turns(sidecar.http_url, TOKEN))
    try:
        settings = Settings(max_turns=TURNS, max_tokens=MAX_TOKENS, temperature=1.0, max_context=512)
        episodes = _play(thread, env_factory("letters", tokenizer, turns=TURNS), 8, settings).result(120)
    finally:
        thread.close()
    tol = _tolerance(model, episodes)
    for ep in episodes:
        assert ep.error is None and ep.turns == TURNS and ep.end == "done"
        mask = torch.tensor(ep.policy_mask, dtype=torch.bool)
        assert 0 < int(mask.sum()) <= TURNS * MAX_TOKENS and 0 < int((~mask).sum())  # the env's turns are context
        assert all(v == version for v, m in zip(ep.weight_versions, ep.policy_mask) if m)
        diff = (_policy_logprobs(model, ep) - torch.tensor(ep.logprobs)).abs()[mask]
        assert diff.max().item() <= tol, (diff.max().item(), tol)
        spliced = [m for m in ep.messages if m["role"] == "assistant"]
        assert sum(len(m["token_ids"]) for m in spliced) == int(mask.sum()) and len(spliced) == TURNS
    prompts = {tuple(ep.prompt_token_ids) for ep in episodes[:2]}
    assert len(prompts) == 1  # one environment seed, one first prompt


class _PushAfterFirstTurn:
    """Wraps a letter game: the first assistant turn to end anywhere holds every episode (the loop
    they share) until the test has pushed new weights; the other episodes are mid-turn then."""

    def __init__(self, game, reached: threading.Event, pushed: threading.Event):
        self.game, self.reached, self.pushed = game, reached, pushed

    def reset(self, seed):
        return self.game.reset(seed)

    def step(self, message, token_ids):
        if not self.reached.is_set():
            self.reached.set()
            assert self.pushed.wait(120)
        return self.game.step(message, token_ids)


def _play_across_a_push(sidecar, zmq, tokenizer, hf_models, settings, n=8):
    v0_model = hf_models["qwen2"]
    v0 = _serve(zmq, v0_model)
    v1_model = _perturbed(v0_model, 11).eval()
    reached, pushed = threading.Event(), threading.Event()
    game = env_factory("letters", tokenizer, turns=TURNS)
    settings.newest_version = lambda: v0 + pushed.is_set()
    thread = client_turns(sidecar.url, TOKEN, tokenizer)
    try:
        future = _play(thread, lambda: _PushAfterFirstTurn(game(), reached, pushed), n, settings, seed0=5)
        assert reached.wait(120)
        zmq.push_weights(v1_model, version=v0 + 1, pause_mode="keep")
        pushed.set()
        episodes = future.result(120)
    finally:
        pushed.set()
        thread.close()
    return episodes, {v0: v0_model, v0 + 1: v1_model}


def test_an_episode_spanning_a_keep_push_matches_each_tokens_own_weights(sidecar, zmq, tokenizer, hf_models):
    """Tokens sampled under version v match the forward of version v's weights. A turn the push froze
    mid-way (keep) goes on under the new weights over the old weights' KV cache: its tokens after the
    switch are exactly what no single forward reproduces (the recipe's importance weights correct them),
    so those alone are left out."""
    settings = Settings(max_turns=TURNS, max_tokens=MAX_TOKENS, max_context=512)
    episodes, models = _play_across_a_push(sidecar, zmq, tokenizer, hf_models, settings)
    tol = max(_tolerance(m, episodes) for m in models.values())
    spanning = checked = 0
    for ep in episodes:
        assert ep.error is None and ep.turns == TURNS
        versions = torch.tensor(ep.weight_versions)
        policy = torch.tensor(ep.policy_mask, dtype=torch.bool)
        assert sorted(set(versions[policy].tolist())) <= sorted(models) and versions[policy].tolist() == sorted(
            versions[policy].tolist())  # versions never go down within an episode
        turn_of = torch.cumsum(torch.cat([torch.tensor([1]), (policy[1:] & ~policy[:-1]).long()]), 0)
        after_switch = torch.zeros_like(policy)
        for t in set(turn_of[policy].tolist()):  # a turn the push landed in: its tokens after the switch
            in_turn = policy & (turn_of == t)
            if len(set(versions[in_turn].tolist())) > 1:
                after_switch |= in_turn & (versions == max(models))
        spanning += len(set(versions[policy].tolist())) > 1
        for v, model in models.items():
            keep = policy & (versions == v) & ~after_switch
            if keep.any():
                diff = (_policy_logprobs(model, ep) - torch.tensor(ep.logprobs)).abs()[keep]
                assert diff.max().item() <= tol, (v, diff.max().item(), tol)
                checked += int(keep.sum())
    assert spanning >= 1 and checked >= sum(map(sum, (ep.policy_mask for ep in episodes))) // 2
    # the held episode's next turns were all sampled after the push: whole turns under the new weights
    assert any(ep.weight_versions[-1] == max(models) and ep.weight_versions[ep.policy_mask.index(1)] == min(models)
               for ep in episodes)


def test_the_staleness_bound_replays_an_episode_that_a_push_left_behind(sidecar, zmq, tokenizer, hf_models):
    settings = Settings(max_turns=TURNS, max_tokens=MAX_TOKENS, max_context=512, max_staleness=0)
    episodes, models = _play_across_a_push(sidecar, zmq, tokenizer, hf_models, settings)
    v1 = max(models)
    assert not any(ep.stale for ep in episodes)
    for ep in episodes:  # every one started under the old weights and was played again from its start
        assert ep.restarts == 1 and ep.turns == TURNS and ep.error is None
        assert all(v == v1 for v, m in zip(ep.weight_versions, ep.policy_mask) if m)


class _Faulty:
    def __init__(self, game, where: str):
        self.game, self.where, self.turn = game, where, 0

    def reset(self, seed):
        if self.where == "reset" and seed % 3 == 1:
            raise RuntimeError("no such level")
        return self.game.reset(seed)

    def step(self, message, token_ids):
        self.turn += 1
        if self.where == "step" and self.turn == 2:
            raise KeyError("the game's state is gone")
        return self.game.step(message, token_ids)


def test_an_environment_that_raises_ends_only_its_episode(sidecar, zmq, tokenizer, hf_models, caplog):
    _serve(zmq, hf_models["qwen2"])
    game = env_factory("letters", tokenizer, turns=TURNS)
    thread = client_turns(sidecar.url, TOKEN, tokenizer)
    settings = Settings(max_turns=TURNS, max_tokens=MAX_TOKENS, max_context=512)
    try:
        with caplog.at_level(logging.WARNING, logger="recipes.episodes"):
            in_reset = thread.submit(run_episodes, lambda: _Faulty(game(), "reset"), list(range(6)),
                                     list(range(6)), settings).result(120)
            in_step = thread.submit(run_episodes, lambda: _Faulty(game(), "step"), [0, 1], [7, 8],
                                    settings).result(120)
            after = _play(thread, game, 2, settings).result(120)  # the loop and the sidecar go on serving
    finally:
        thread.close()
    failed = [ep for ep in in_reset if ep.error]
    assert [ep.end for ep in in_reset].count("error") == 2 and all("no such level" in ep.error for ep in failed)
    assert all(ep.turns == TURNS and ep.error is None for ep in in_reset if ep not in failed)
    assert all(ep.error.startswith("KeyError") and ep.turns == 2 and not ep.trainable for ep in in_step)
    assert all(ep.error is None and ep.turns == TURNS for ep in after)
    assert caplog.text.count("the environment raised") == 4 and "no such level" in caplog.text


class _Refused:
    """A letter game whose requests the sidecar refuses for some seeds: a first prompt over the
    sidecar's max_model_len (seed % 3 == 1) or, after the first turn, a tool message whose
    `tool_call_id` names no call (seed % 3 == 2: the OpenAI front's 400; ZMQ renders it)."""

    def __init__(self, game):
        self.game, self.seed = game, None

    def reset(self, seed):
        self.seed = seed
        first = self.game.reset(seed)
        if seed % 3 == 1:
            first.messages[0]["content"] += " a" * 600
        return first

    def step(self, message, token_ids):
        step = self.game.step(message, token_ids)
        if self.seed % 3 == 2:
            step.messages.append({"role": "tool", "tool_call_id": "call_nowhere", "content": "{}"})
        return step


@pytest.mark.parametrize("transport", ["client", "openai"])
def test_a_request_the_sidecar_refuses_ends_only_its_episode(sidecar, zmq, tokenizer, hf_models, transport, caplog):
    _serve(zmq, hf_models["qwen2"])
    game = env_factory("letters", tokenizer, turns=TURNS)
    thread = (client_turns(sidecar.url, TOKEN, tokenizer) if transport == "client"
              else openai_turns(sidecar.http_url, TOKEN))
    settings = Settings(max_turns=TURNS, max_tokens=MAX_TOKENS, max_context=512)
    try:
        with caplog.at_level(logging.WARNING, logger="recipes.episodes"):
            played = thread.submit(run_episodes, lambda: _Refused(game()), list(range(6)), list(range(6)),
                                   settings).result(120)
            after = _play(thread, game, 2, settings).result(120)  # the loop and the sidecar go on serving
    finally:
        thread.close()
    too_long = [ep for seed, ep in enumerate(played) if seed % 3 == 1]
    bad_id = [ep for seed, ep in enumerate(played) if seed % 3 == 2]
    fine = [ep for seed, ep in enumerate(played) if seed % 3 == 0]
    assert all(ep.end == "error" and ep.error_in == "turn" and ep.turns == 0 and not ep.trainable
               and "max_model_len" in ep.error for ep in too_long)
    if transport == "openai":  # a 400 naming the id, after the first turn was played
        assert all(ep.end == "error" and ep.error_in == "turn" and ep.turns == 1 and not ep.trainable
                   and "HTTP 400" in ep.error and "call_nowhere" in ep.error for ep in bad_id)
        assert all("HTTP 400" in ep.error for ep in too_long)
    else:
        fine += bad_id
    assert all(ep.error is None and ep.turns == TURNS and ep.trainable for ep in fine + after)
    failed = len(played) - len(fine)
    assert episode_metrics(played)["episodes/turn_errors"] == failed == episode_metrics(played)["episodes/errors"]
    assert caplog.text.count("the sidecar refused or failed the request") == failed
