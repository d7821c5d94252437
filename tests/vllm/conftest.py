"""Fixtures of the vLLM tests: each module starts its own sidecar (`sidecar`, a vLLM start costs
20-50 s on 2 cores), and these drive it."""

import copy

import pytest

from engine import SamplingParams
from tests.engine.helpers import hf_greedy


@pytest.fixture(scope="module")
def client(sidecar):
    from rollout import RolloutClient
    from tests.rollout.sidecar import TOKEN

    c = RolloutClient(sidecar.url, token=TOKEN)
    yield c
    c.close()


@pytest.fixture(scope="module")
def trainer(hf_models):
    """The trainer's policy: a copy of the checkpoint the module's tests may perturb and push."""
    return copy.deepcopy(hf_models["qwen2"])


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def greedy(client, prompts) -> list[list[int]]:
    return [g[0].token_ids for g in client.generate(prompts, GREEDY)]


def hf_greedy_all(model, prompts) -> list[list[int]]:
    return [hf_greedy(model, p, GREEDY.max_tokens, ignore_eos=True) for p in prompts]
