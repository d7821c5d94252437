"""The real sidecar on `--engine vllm` (vLLM's CPU build, fp32), driven by the real clients: one
sidecar of two vLLM engines for the module (a vLLM start costs 20-50 s on 2 cores)."""

import concurrent.futures
import copy
import os
import time

import httpx
import openai
import pytest

pytest.importorskip("vllm")

from engine import SamplingParams  # noqa: E402
from rollout import RolloutClient, SidecarError  # noqa: E402
from tests.engine.helpers import (  # noqa: E402
    activation_magnitude, fp32_logprob_tolerance, hf_greedy, hf_logprobs, random_prompts,
)
from tests.rollout.in_flight import kill_mid_decode  # noqa: E402
from tests.rollout.sidecar import TOKEN, Sidecar  # noqa: E402
from tests.rollout.test_sidecar import perturb  # noqa: E402

pytestmark = pytest.mark.timeout(300)
MODEL = "policy"


@pytest.fixture(scope="module")
def sidecar(qwen2_dir, tmp_path_factory):
    s = Sidecar(qwen2_dir, "--engine", "vllm", "--num-engines", "2", "--http-port", "0",
                "--served-model-name", MODEL, "--host-copy", "off",
                log_path=str(tmp_path_factory.mktemp("vllm-sidecar") / "sidecar.log"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(sidecar):
    c = openai.OpenAI(base_url=sidecar.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
    yield c
    c.close()


def _close(model, prompt, rollout, temperature):
    """Each token's logprob against HF's full forward, within fp32 rounding."""
    want = hf_logprobs(model, prompt, rollout.token_ids, temperature)
    tol = fp32_logprob_tolerance(model.config, activation_magnitude(model, prompt + rollout.token_ids))
    return max(abs(a - b) for a, b in zip(rollout.logprobs, want)) <= tol


def test_groups_of_n_are_greedy_as_hf_token_for_token(client, hf_models):
    model = hf_models["qwen2"]
    prompts = random_prompts(6, 5, 30, 2000, seed=31)
    groups = client.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True))
    assert [len(g) for g in groups] == [2] * 6
    for p, g in zip(prompts, groups):
        ref = hf_greedy(model, p, 16, ignore_eos=True)
        for r in g:
            assert r.prompt_token_ids == p and r.token_ids == ref and r.finish_reason == "length"
            assert r.weight_versions == [0] * 16 and _close(model, p, r, 1.0)
    assert client.stats()["requests_per_engine"][1] > 0  # both engines served


def test_logprobs_are_the_sampling_distributions(client, hf_models):
    """vLLM's logprobs_mode processed_logprobs: log softmax(logits / T), what importance ratios need."""
    model = hf_models["qwen2"]
    prompts = random_prompts(3, 5, 20, 2000, seed=32)
    groups = client.generate(prompts, SamplingParams(n=3, temperature=0.7, max_tokens=12, ignore_eos=True))
    for p, g in zip(prompts, groups):
        for r in g:
            assert len(r.logprobs) == len(r.token_ids) == 12
            assert _close(model, p, r, 0.7) and not _close(model, p, r, 1.0)


def test_conversations_go_through_the_chat_template(client, hf_models):
    from transformers import AutoTokenizer

    conv = [{"role": "user", "content": "Name a color."}]
    [group] = client.generate(conv, SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    tok = AutoTokenizer.from_pretrained(hf_models["qwen2"].name_or_path)
    want = list(tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert len(group) == 2 and all(r.prompt_token_ids == want and len(r.token_ids) == 5 for r in group)


def test_a_stream_is_the_whole_response_in_pieces(oai):
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    messages = [{"role": "user", "content": "count to ten"}]
    whole = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, **greedy).choices[0]
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True, **greedy))
    body = [c.choices[0] for c in chunks if c.choices]
    assert len(body) > 2  # in pieces
    assert "".join(c.delta.content or "" for c in body) == whole.message.content
    assert [t for c in body for t in (c.token_ids or [])] == whole.token_ids and len(whole.token_ids) == 20
    assert [v for c in body for v in (c.weight_versions or [])] == whole.weight_versions == [0] * 20
    assert [c.finish_reason for c in body if c.finish_reason] == ["length"]


def test_a_client_that_leaves_mid_stream_has_its_requests_aborted(sidecar, client):
    body = {"model": MODEL, "prompt": [5] * 10, "max_tokens": 240, "n": 8, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.stream("POST", sidecar.http_url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the stream, and the client has left already
        first = next(line for line in lines if line.startswith("data:"))
        stats = client.stats()
        assert "text" in first and stats["queue_depth"] == 8, stats  # far from done: 8 x 240 tokens
    deadline = time.monotonic() + 10
    while client.stats()["queue_depth"]:  # the connection is gone: its engine requests are aborted
        assert time.monotonic() < deadline, "the requests of a client that left still run"
        time.sleep(0.05)
    [[r]] = client.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(r.token_ids) == 4


def test_a_seeded_request_fails_alone_on_the_cpu_build(client):
    """A per-request seed kills vLLM's CPU engine core: the adapter refuses it before it gets there."""
    with pytest.raises(SidecarError, match="seed"):
        client.generate([[5, 6, 7], [8, 9]], SamplingParams(seed=3, max_tokens=4))
    [[r]] = client.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(r.token_ids) == 4
    health = client.health()
    assert health["ok"] and health["engines"] == 2 and client.stats()["engine_deaths"] == 0


def _wait_healthy(client, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not (health := client.health())["ok"]:
        assert time.monotonic() < deadline, f"not healthy {timeout} s after the kill: {health}"
        time.sleep(0.2)
    return health


def test_an_engine_core_killed_under_load_loses_no_rollout_and_comes_back(sidecar, client, hf_models):
    """Last in the module: it costs a vLLM restart. The engine comes back with the pushed weights,
    copied from its sibling."""
    model = copy.deepcopy(hf_models["qwen2"])
    perturb(model, 12, scale=0.05)
    client.init_weight_sync(take_over=True)
    client.push_weights(model, version=1)
    want = client._client.sender.checksum(model)
    prompts = random_prompts(16, 5, 20, 2000, seed=33)
    params = SamplingParams(n=2, temperature=0, max_tokens=40, ignore_eos=True)
    victim = client.health()["engine_states"][1]["pid"]
    loader, marker = RolloutClient(sidecar.url, token=TOKEN), RolloutClient(sidecar.url, token=TOKEN)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pending = kill_mid_decode(client, marker, pool, lambda: pool.submit(loader.generate, prompts, params),
                                      seqs=2 * len(prompts), victim=1)
            groups = pending.result(timeout=240)
    finally:
        marker.close()
        loader.close()
    for p, g in zip(prompts, groups):  # every rollout whole, greedy as HF, however it was pieced together
        ref = hf_greedy(model, p, 40, ignore_eos=True)
        assert [r.token_ids for r in g] == [ref, ref] and all(r.weight_versions == [1] * 40 for r in g)
    stats = client.stats()
    assert stats["engine_deaths"] == 1 and stats["resubmitted_after_engine_death"] >= 1
    health = _wait_healthy(client, 180)
    assert [s["restarts"] for s in health["engine_states"]] == [0, 1]
    assert health["engine_states"][1]["pid"] != victim
    assert client.stats()["last_restart"]["source"] == "engine 0"
    assert client.weights_checksums() == [want, want]
    groups = client.generate(prompts[:4], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    assert [g[0].token_ids for g in groups] == [hf_greedy(model, p, 8, ignore_eos=True) for p in prompts[:4]]


def test_a_stopped_vllm_sidecar_exits_cleanly_and_leaks_no_shared_memory(sidecar, client):
    """Last in the module. SIGTERM gives vLLM's cores and workers the time to exit on their own:
    none is force-killed (force-killed after 2 s, each core left its shared memory to Python's
    resource tracker, which warned of it). Only a core that was SIGKILLed (the test before kills
    one) cannot clean up after itself: the tracker removes its segment, and no more."""
    import re

    deaths = client.stats()["engine_deaths"]
    start = os.path.getsize(sidecar.log_path)  # what the tests before logged (a killed core's restart) aside
    assert sidecar.stop(timeout_s=90) == 0  # a clean exit, not a fast one: on loaded cores vLLM's exit took > 20 s
    with open(sidecar.log_path) as f:
        f.seek(start)
        text = f.read()
    assert "force killing" not in text, text[-3000:]
    leaked = sum(int(n) for n in re.findall(r"There appear to be (\d+) leaked shared_memory", text))
    assert leaked <= deaths, text[-3000:]
