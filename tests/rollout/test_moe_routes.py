"""Routed experts through the sidecar: the rollout manager joins a resubmitted sample's rows as if it
had never been cut, and the HTTP fronts (OpenAI's completions and chat, SGLang's /generate) return
them as vLLM's and SGLang's servers do (base64 of the array's .npy bytes)."""

import base64
import io

import httpx
import numpy as np
import pytest

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from rollout.sidecar.manager import RolloutManager, _Sample
from tests.engine.helpers import random_prompts
from tests.rollout.sidecar import TOKEN, Sidecar

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def manager(moe_dir, loop):
    engine = AsyncEngine(EngineConfig(model=moe_dir, max_model_len=256))
    yield RolloutManager([engine])
    engine.shutdown()


def _npy(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def test_a_resubmitted_sample_carries_the_rows_of_an_uncut_one(manager, moe_dir, loop):
    prompt = random_prompts(1, 9, 9, 2000, seed=21)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_routed_experts=True)
    whole = loop.run_until_complete(manager.generate_group(prompt, params))[0]
    rows = whole.routed_experts_array()
    assert rows.shape == (9 + 12 - 1, 4, 2) and rows.dtype == np.uint8
    offline = LLM(EngineConfig(model=moe_dir, max_model_len=256)).generate([prompt], params, use_tqdm=False)
    assert np.array_equal(rows, offline[0].outputs[0].routed_experts)

    k = 5  # what an abort pause after 5 tokens leaves: their rows, the 5th token's not yet computed
    sample = _Sample(0)
    sample.token_ids, sample.logprobs, sample.versions = whole.token_ids[:k], whole.logprobs[:k], [0] * k
    sample.finish_reason, sample.routed = "abort", [rows[:9 + k - 1]]
    loop.run_until_complete(manager._complete(prompt, params, sample))
    resumed = manager._to_rollout(prompt, params, sample)
    assert resumed.token_ids == whole.token_ids
    assert np.array_equal(resumed.routed_experts_array(), rows)  # the continuation's prefill: the same routes


@pytest.fixture(scope="module")
def front(moe_dir):
    s = Sidecar(moe_dir, "--http-port", "0", "--served-model-name", "policy", "--max-model-len", "256",
                "--sglang-routes")
    yield s
    s.stop()


def test_the_http_fronts_return_routed_experts_as_vllm_and_sglang_do(front):
    base = front.http_url
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = {"model": "policy", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_routed_experts": True, "routed_experts_prompt_start": 2}
    with httpx.Client(timeout=60) as http:
        done = http.post(f"{base}/v1/completions", json=body, headers=headers).json()
        choice = done["choices"][0]
        rows = _npy(choice["routed_experts"])
        assert rows.shape == (4 - 2 + 6 - 1, 4, 2) and rows.dtype == np.uint8
        chat = http.post(f"{base}/v1/chat/completions", headers=headers, json={
            "model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "return_routed_experts": True}).json()
        assert _npy(chat["choices"][0]["routed_experts"]).shape[1:] == (4, 2)
        sg = http.post(f"{base}/generate", headers=headers, json={
            "input_ids": [5, 6, 7, 8], "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
        assert np.array_equal(_npy(sg["meta_info"]["routed_experts"])[2:], rows)
        plain = http.post(f"{base}/v1/completions", json={**body, "return_routed_experts": False}, headers=headers)
        assert "routed_experts" not in plain.json()["choices"][0]
