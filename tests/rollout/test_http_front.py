"""The OpenAI-compatible HTTP front (issue 14), driven by the official `openai` client against a real
sidecar on loopback, beside a ZMQ client on the same engines."""

import asyncio
import copy
import json
import shutil

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from rollout import AsyncRolloutClient, RolloutClient
from tests.engine.helpers import hf_greedy, random_prompts
from tests.rollout.sidecar import TOKEN, Sidecar, openai_client
from tests.rollout.test_engine_faults import _perturbed

pytestmark = pytest.mark.timeout(300)

MODEL = "policy"
# the tiny model's template, taking tools the way Qwen's does (a system block that lists them)
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nYou may call: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tools_dir(qwen2_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tools_model") / "qwen2"
    shutil.copytree(qwen2_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def front(tools_dir):
    s = Sidecar(tools_dir, "--http-port", "0", "--served-model-name", MODEL, "--max-model-len", "1024")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(front):
    c = openai_client(front)
    yield c
    c.close()


@pytest.fixture(scope="module")
def zmq(front):
    c = RolloutClient(front.url, token=TOKEN)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(tools_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_dir)


def _raw(front, method, path, token=TOKEN, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, front.http_url + path, headers=headers, timeout=60, **kw)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_completions_and_chat_give_the_engines_tokens(front, oai, zmq, tokenizer, hf_models):
    """Greedy through HTTP = greedy through ZMQ = HF generate, token for token; every response
    carries the prompt's ids, the completion's ids and each token's weight version."""
    hf = hf_models["qwen2"]
    for p in random_prompts(3, 5, 20, 2000, seed=11):
        r = oai.completions.create(model=MODEL, prompt=p, max_tokens=12, **GREEDY)
        c = r.choices[0]
        assert c.prompt_token_ids == p and c.token_ids == hf_greedy(hf, p, 12, ignore_eos=True)
        assert c.weight_versions == [0] * 12 and c.finish_reason == "length"
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == 12
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is seven plus five"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, **GREEDY)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
    [[zr]] = zmq.generate([messages], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert r.prompt_token_ids == ids == zr.prompt_token_ids
    assert r.choices[0].token_ids == zr.token_ids == hf_greedy(hf, ids, 10, ignore_eos=True)
    assert r.choices[0].message.content == zr.text and r.choices[0].message.role == "assistant"
    text_prompt = oai.completions.create(model=MODEL, prompt="seven plus five is", max_tokens=4, **GREEDY)
    assert text_prompt.choices[0].prompt_token_ids == tokenizer("seven plus five is")["input_ids"]


def test_a_stream_is_the_whole_response_in_pieces(oai):
    messages = [{"role": "user", "content": "count to ten"}]
    whole = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **GREEDY).choices[0]
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].prompt_token_ids
    body = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.delta.content or "" for c in body) == whole.message.content
    assert [t for c in body for t in (c.token_ids or [])] == whole.token_ids
    assert [v for c in body for v in (c.weight_versions or [])] == whole.weight_versions
    assert [c.finish_reason for c in body if c.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    # completions stream the same way
    prompt = random_prompts(1, 8, 8, 2000, seed=12)[0]
    whole = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY).choices[0]
    pieces = [c.choices[0] for c in oai.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True,
                                                           **GREEDY)]
    assert "".join(p.text for p in pieces) == whole.text
    assert [t for p in pieces for t in p.token_ids] == whole.token_ids


def test_n_samples_and_seeds(oai):
    def ask(seed, stream=False):
        kw = {"model": MODEL, "messages": [{"role": "user", "content": "a story"}], "n": 3, "max_tokens": 10,
              "temperature": 1.0, "seed": seed, "extra_body": {"ignore_eos": True}}
        if not stream:
            return [c.token_ids for c in sorted(oai.chat.completions.create(**kw).choices, key=lambda c: c.index)]
        out = [[], [], []]
        for chunk in oai.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                out[c.index] += getattr(c, "token_ids", None) or []
        return out

    first = ask(5)
    assert len(first) == 3 and all(len(t) == 10 for t in first)
    assert ask(5) == first  # the same seed, the same samples
    assert ask(5, stream=True) == first  # streamed or not
    assert ask(6) != first


def test_logprobs_as_openai_writes_them(oai, zmq):
    prompt = random_prompts(1, 6, 6, 2000, seed=13)[0]
    c = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=3, **GREEDY).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0
        assert value == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the sampled token is the most likely
    [[zr]] = zmq.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert lp.token_logprobs == pytest.approx(zr.logprobs, abs=1e-4)
    ch = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                     logprobs=True, top_logprobs=2, **GREEDY).choices[0]
    assert len(ch.logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    assert ch.logprobs.content[0].bytes == list(ch.logprobs.content[0].token.encode())


def test_stop_strings_end_the_text_before_them(oai):
    prompt = random_prompts(1, 6, 6, 2000, seed=14)[0]
    full = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=30, **GREEDY).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    c = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=[stop], **GREEDY).choices[0]
    assert c.finish_reason == "stop" and c.text == full[:full.find(stop)]
    streamed = list(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=stop, stream=True,
                                           **GREEDY))
    assert "".join(s.choices[0].text for s in streamed) == c.text
    assert [t for s in streamed for t in s.choices[0].token_ids] == c.token_ids


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "often"}, "stream"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999999]}, "vocabulary"),
    ("/v1/completions", {"prompt": [5] * 1100}, "max_model_len"),
    ("/v1/completions", {"n": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "hello", "token_ids": [7, 8]}]},
     "token_ids"),
]


def test_bad_requests_get_openai_errors_and_the_server_serves_on(front, oai):
    for path, body, names in BAD_REQUESTS:
        r = _raw(front, "POST", path, json={"model": MODEL, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and names in err["message"], (body, err)
    assert _raw(front, "POST", "/v1/completions", content=b"{not json").status_code == 400
    assert _raw(front, "POST", "/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404
    assert _raw(front, "POST", "/v1/completions", token="wrong", json={"model": MODEL, "prompt": "x"}).status_code == 401
    assert _raw(front, "GET", "/v1/models", token="").status_code == 401
    huge = _raw(front, "POST", "/v1/completions", content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
    assert huge.status_code == 413 and huge.json()["error"]["code"] == 413
    with pytest.raises(openai.BadRequestError):  # the official client raises its own error for them
        oai.completions.create(model=MODEL, prompt="x", temperature=5)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=front.http_url + "/v1", api_key="wrong", max_retries=0).models.list()
    # none of it touched anything: the next request is served
    assert oai.completions.create(model=MODEL, prompt="x", max_tokens=3, **GREEDY).choices[0].token_ids
    assert _raw(front, "GET", "/health", token="").json()["ok"]  # health needs no token (load balancers)


def test_models_and_metrics(front, oai):
    [m] = oai.models.list().data
    assert m.id == MODEL
    oai.completions.create(model=MODEL, prompt="x", max_tokens=3, **GREEDY)
    r = _raw(front, "GET", "/metrics")
    assert r.status_code == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
    for name in ("rollout_generated_tokens_total", "rollout_tokens_per_second", "rollout_groups_in_flight",
                 "rollout_weight_pushes_total", "rollout_pause_seconds_total", "rollout_weight_version"):
        assert name in samples, sorted(samples)
    assert samples["rollout_generated_tokens_total"] > 0
    # each engine's prefix cache (engine/block_manager.py), labelled by engine and kind, and in /health
    prefix = {s.labels["kind"]: s.value for f in text_string_to_metric_families(r.text) for s in f.samples
              if s.name == "rollout_prefix_cache_total" and s.labels["engine"] == "0"}
    assert set(prefix) == {"hit_tokens", "query_tokens", "hit_tokens_other_version", "blocks_dropped"}, prefix
    assert prefix["query_tokens"] > 0 and prefix["hit_tokens_other_version"] == 0
    state = _raw(front, "GET", "/health", token="").json()["engine_states"][0]
    assert state["prefix_cache"]["query_tokens"] >= prefix["query_tokens"]


AGENT = r"""
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
for chunk in c.completions.create(model=sys.argv[3], prompt="x", max_tokens=500, n=4, stream=True,
                                  extra_body={"ignore_eos": True}):
    print("chunk", flush=True)
"""


def test_an_agent_killed_mid_stream_has_its_request_aborted(front, zmq):
    import os
    import signal
    import subprocess
    import sys
    import time

    agent = subprocess.Popen([sys.executable, "-c", AGENT, front.http_url + "/v1", TOKEN, MODEL],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout.readline().strip() == "chunk"
        assert zmq.stats()["queue_depth"] == 4
        os.kill(agent.pid, signal.SIGKILL)
    finally:
        agent.kill()
        agent.wait()
    deadline = time.monotonic() + 10
    while zmq.stats()["queue_depth"]:
        assert time.monotonic() < deadline, "the request of an agent that died still runs"
        time.sleep(0.05)


def test_an_engine_killed_under_http_load_loses_no_request(front, zmq):
    """Its core SIGKILLed while streams and whole requests run: the engine is restarted and every
    request comes back whole, the streamed ones without a gap or a repeat."""
    import os
    import signal
    import time

    async def main():
        ac = openai.AsyncOpenAI(base_url=front.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
        placed, streaming = asyncio.Event(), asyncio.Event()  # every request on the engine; then tokens out

        async def one(i):
            kw = {"model": MODEL, "prompt": f"story {i}", "max_tokens": 120, "temperature": 1.0, "seed": i,
                  "extra_body": {"ignore_eos": True}}
            if i % 2:
                ids = []
                async for chunk in await ac.completions.create(stream=True, **kw):
                    ids += chunk.choices[0].token_ids if chunk.choices else []
                    if ids and placed.is_set():
                        streaming.set()
                return ids
            return (await ac.completions.create(**kw)).choices[0].token_ids

        async def kill():
            zc = AsyncRolloutClient(front.url, token=TOKEN)
            try:
                core = (await zc.health())[0]["engine_states"][0]["pid"]
                while (await zc.stats())[0]["queue_depth"] < 8:  # every request is on the engine
                    await asyncio.sleep(0.01)
                placed.set()
                await streaming.wait()  # and tokens come out of it: each request has most of its 120 to go
                os.kill(core, signal.SIGKILL)
            finally:
                await zc.close()

        try:
            return (await asyncio.gather(asyncio.gather(*(one(i) for i in range(8))), kill()))[0]
        finally:
            await ac.close()

    before = zmq.stats()
    results = asyncio.run(main())
    assert all(len(ids) == 120 for ids in results)
    after = zmq.stats()
    assert after["engine_deaths"] == before["engine_deaths"] + 1
    assert after["resubmitted_after_engine_death"] > before["resubmitted_after_engine_death"]  # hit mid-request
    deadline = time.monotonic() + 60
    while not zmq.health()["ok"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_multi_turn_assistant_turns_come_back_as_their_token_ids(oai, tokenizer):
    turn1 = [{"role": "user", "content": "name a number"}]
    r1 = oai.chat.completions.create(model=MODEL, messages=turn1, max_tokens=12, stop=["e"], **GREEDY)
    c1 = r1.choices[0]
    # cut mid-token by the stop string: the ids hold text the content does not, so no re-tokenising
    # of the content could give them back
    assert c1.finish_reason == "stop" and tokenizer.decode(c1.token_ids) != c1.message.content
    turn2 = turn1 + [{"role": "assistant", "content": c1.message.content, "token_ids": c1.token_ids},
                     {"role": "user", "content": "and another"}]
    r2 = oai.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, **GREEDY)
    # the exact sequence the policy produced, then the template's text after it
    assert r2.prompt_token_ids[:len(r1.prompt_token_ids) + len(c1.token_ids)] == r1.prompt_token_ids + c1.token_ids
    tail = tokenizer.decode(r2.prompt_token_ids[len(r1.prompt_token_ids) + len(c1.token_ids):])
    assert tail == "<|im_end|>\n<|im_start|>user\nand another<|im_end|>\n<|im_start|>assistant\n"


# long enough that a push lands while they run on a fast host: 96 tokens each were done in 0.4-1 s
# on an Intel Xeon with AMX, before the module's first push (0.2-0.4 s, its group's set-up) landed
TOKENS = 256


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_pushes_under_http_load_lose_nothing(front, hf_models, mode):
    """Streams and whole requests, chat and completions, while the trainer pushes three versions:
    every request answered whole, versions per token never go down."""
    trainer = copy.deepcopy(hf_models["qwen2"])

    async def main():
        zc = AsyncRolloutClient(front.url, token=TOKEN)
        ac = openai.AsyncOpenAI(base_url=front.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
        try:
            await zc.init_weight_sync(take_over=True)
            base = (await zc.stats())[0]["version"]

            async def one(i):
                kw = {"model": MODEL, "max_tokens": TOKENS, "temperature": 1.0, "seed": i, "extra_body": {"ignore_eos": True}}
                if i % 2:
                    kw["messages"] = [{"role": "user", "content": f"tell me {i}"}]
                    call = ac.chat.completions.create
                else:
                    kw["prompt"] = f"once upon a time {i}"
                    call = ac.completions.create
                if i % 3 == 0:
                    ids, versions, finish = [], [], None
                    async for chunk in await call(stream=True, **kw):
                        for c in chunk.choices:
                            ids += c.token_ids or []
                            versions += c.weight_versions or []
                            finish = c.finish_reason or finish
                    return ids, versions, finish
                c = (await call(**kw)).choices[0]
                return c.token_ids, c.weight_versions, c.finish_reason

            async def pushes():
                while not (await zc.stats())[0]["queue_depth"]:  # the first push lands mid-generation
                    await asyncio.sleep(0.01)
                for k in range(1, 4):
                    await zc.push_weights(_perturbed(trainer, k), version=base + k, pause_mode=mode)
                    await asyncio.sleep(0.1)

            results, _ = await asyncio.gather(asyncio.gather(*(one(i) for i in range(12))), pushes())
            return base, results
        finally:
            await ac.close()
            await zc.close()

    base, results = asyncio.run(main())
    for ids, versions, finish in results:
        assert len(ids) == len(versions) == TOKENS and finish == "length"
        assert versions == sorted(versions) and base <= versions[0] and versions[-1] <= base + 3
    if mode != "wait":  # a push lands mid-request in keep and abort modes
        assert any(len(set(v)) > 1 for _, v, _ in results)


def test_an_agent_loop_feeds_a_grpo_update(front, oai, tools_dir):
    """A scripted tool-use environment: the agent asks, the model answers, the environment replies as
    a calculator tool, the model answers again; the turns, token ids as returned, go into one GRPO
    update of the recipe code, whose own forward gives the engine's logprobs back."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.algorithms import GRPO
    from recipes.rl_train import Run, build_parser, update
    from recipes.task_defaults import fill_task_defaults
    from rollout.common.types import Rollout
    from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance

    zc = RolloutClient(front.url, token=TOKEN)
    policy = AutoModelForCausalLM.from_pretrained(tools_dir, dtype=torch.float32)
    zc.init_weight_sync(take_over=True)
    version = zc.stats()["version"] + 1
    zc.push_weights(policy, version=version)  # the engines serve exactly the policy being trained
    zc.close()
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    episodes = []
    for ep in range(4):
        messages = [{"role": "user", "content": "what is 17 times 23? use the calculator"}]
        turns = []
        for step in range(2):
            r = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=12,
                                            temperature=1.0, seed=100 + ep, logprobs=True)
            c = r.choices[0]
            turns.append(Rollout(r.prompt_token_ids, c.token_ids, [t.logprob for t in c.logprobs.content],
                                 c.message.content, c.finish_reason, c.weight_versions, step))
            messages += [{"role": "assistant", "content": c.message.content, "token_ids": c.token_ids},
                         {"role": "tool", "content": json.dumps({"result": 17 * 23})}]
        assert turns[1].prompt_token_ids[:len(turns[0].prompt_token_ids) + len(turns[0].token_ids)] == \
            turns[0].prompt_token_ids + turns[0].token_ids
        reward = sum(ch.isdigit() for ch in turns[-1].text) / max(len(turns[-1].text), 1)
        episodes.append((turns, reward))
    assert all(v == version for turns, _ in episodes for t in turns for v in t.weight_versions)
    # turn 0 of every episode, then turn 1: two groups of 4, each turn with its episode's reward
    rollouts = [turns[k] for k in range(2) for turns, _ in episodes]
    rewards = torch.tensor([reward for _ in range(2) for _, reward in episodes])
    args = fill_task_defaults(build_parser("grpo").parse_args(
        ["--group-size", "4", "--max-tokens", "12", "--temperature", "1.0", "--beta", "0", "--report-to", "none"]))
    accelerator = Accelerator(cpu=True)
    algo = GRPO(args)
    module = algo.wrap(policy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    module, optimizer = accelerator.prepare(module, optimizer)
    tokenizer = AutoTokenizer.from_pretrained(tools_dir)
    run = Run(args, algo, accelerator, module, optimizer, None, tokenizer, None, None, None, None)
    longest = max(rollouts, key=lambda r: len(r.prompt_token_ids) + len(r.token_ids))
    tol = fp32_logprob_tolerance(policy.config, activation_magnitude(policy, longest.prompt_token_ids +
                                                                     longest.token_ids))
    before = [p.detach().clone() for p in policy.parameters()]
    metrics = update(run, rollouts, rewards)
    assert metrics["sampling/sampling_logp_difference/max"] <= tol  # the trainer scores exactly what was sampled
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_sigterm_ends_http_streams_with_an_error_and_exits(qwen2_dir):
    """A stream in flight when the sidecar is told to stop ends at once with an error event (the
    openai client raises it), and the sidecar exits cleanly within seconds."""
    import signal
    import time

    s = Sidecar(qwen2_dir, "--http-port", "0", "--served-model-name", MODEL)
    client = openai.OpenAI(base_url=s.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    try:
        stream = client.completions.create(model=MODEL, prompt="x", max_tokens=200, n=2, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 10
        assert s.proc.wait(20) == 0
    finally:
        client.close()
        s.stop()
