"""The HTTP front against what vLLM's own OpenAI-server tests ask of it (issue 26): refusals that are
400s naming the field on a connection that stays usable, nothing silently ignored (logit_bias, the
context length), echo with prompt logprobs, and the engine's sampling parameters on both endpoints.
Driven by raw httpx and the official `openai` client against a real sidecar."""

import httpx
import pytest

from engine import SamplingParams
from tests.engine.helpers import hf_logprobs, random_prompts
from tests.rollout.sidecar import TOKEN, Sidecar, openai_client

pytestmark = pytest.mark.timeout(300)

MODEL = "policy"
MAX_MODEL_LEN = 256
VOCAB = 2048  # the tiny model's
GREEDY = {"temperature": 0, "ignore_eos": True}
USER = [{"role": "user", "content": "name three colours"}]


@pytest.fixture(scope="module")
def front(qwen2_dir):
    s = Sidecar(qwen2_dir, "--http-port", "0", "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(front):
    """One client, so one kept-alive connection: a request that broke it would fail the next."""
    with httpx.Client(base_url=front.http_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(front):
    c = openai_client(front)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(qwen2_tokenizer):
    return qwen2_tokenizer


def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http, path: str, **body) -> list[dict]:
    import json

    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
REFUSED = [  # (path, body, the field the error names)
    (CMPL, {"prompt": "x", "seed": 2**63}, "seed"),
    (CMPL, {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    (CMPL, {"prompt": "x", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    (CMPL, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    (CHAT, {"messages": USER, "stop_token_ids": [10**9]}, "stop_token_ids"),
    (CMPL, {"prompt": "x", "logit_bias": {str(VOCAB + 5): 1}}, "logit_bias"),
    (CMPL, {"prompt": "x", "logit_bias": {"-3": 1}}, "logit_bias"),
    (CMPL, {"prompt": "x", "logit_bias": {"seven": 1}}, "logit_bias"),
    (CMPL, {"prompt": "x", "allowed_token_ids": [1, VOCAB]}, "allowed_token_ids"),
    (CMPL, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    (CMPL, {"prompt": "x", "bad_words": [" "]}, "bad_words"),
    (CMPL, {"prompt": "x", "min_tokens": 17}, "min_tokens"),  # above max_tokens (16)
    (CMPL, {"prompt": "x", "logprobs": 21}, "logprobs"),  # above the engine's max_logprobs
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CMPL, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "maximum context length is 256 tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": MAX_MODEL_LEN - 10}, "maximum context length is 256"),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": USER, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": USER, "tools": []}, "tools"),
    (CHAT, {"messages": USER, "tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "calculator"}}}, "tool_choice"),
]


@pytest.mark.parametrize("path,body,names", REFUSED, ids=[f"{i}-{'-'.join(sorted(b.keys() - {'prompt', 'messages'}))}"
                                                          for i, (_, b, _) in enumerate(REFUSED)])
def test_bad_values_are_400s_naming_the_field_on_a_connection_that_stays_usable(http, path, body, names):
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and names in err["message"], err
    # the same connection serves the next request (a 500 closed it)
    assert _complete(http, prompt="x", max_tokens=2)["choices"][0]["token_ids"]


def test_the_context_bounds_prompt_and_completion_together(http):
    prompt = random_prompts(1, 220, 220, VOCAB, seed=3)[0]
    ok = _complete(http, prompt=prompt, max_tokens=MAX_MODEL_LEN - 220, **GREEDY)  # exactly full
    assert len(ok["choices"][0]["token_ids"]) == MAX_MODEL_LEN - 220
    r = http.post(CMPL, json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_MODEL_LEN - 219})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "you requested 37 output tokens and your prompt contains 220 input tokens" in r.json()["error"]["message"]
    # chat without max_tokens: what the prompt leaves of the context, as vLLM's
    whole = _chat(http, messages=[{"role": "user", "content": "one two three four " * 16}], **GREEDY)
    assert len(whole["prompt_token_ids"]) + len(whole["choices"][0]["token_ids"]) == MAX_MODEL_LEN
    assert whole["choices"][0]["finish_reason"] == "length"
    # completions' max_tokens null is OpenAI's default (16), not the rest of the context
    assert len(_complete(http, prompt="x", max_tokens=None, **GREEDY)["choices"][0]["token_ids"]) == 16


def test_logit_bias_moves_tokens_in_and_out(http, tokenizer):
    prompt = random_prompts(1, 6, 6, VOCAB, seed=21)[0]
    greedy = _complete(http, prompt=prompt, max_tokens=4, **GREEDY)["choices"][0]["token_ids"]
    forced = next(t for t in range(100, VOCAB) if t not in greedy)
    up = _complete(http, prompt=prompt, max_tokens=4, logit_bias={str(forced): 100}, **GREEDY)
    assert up["choices"][0]["token_ids"] == [forced] * 4
    down = _complete(http, prompt=prompt, max_tokens=4, logit_bias={str(greedy[0]): -100}, **GREEDY)
    assert down["choices"][0]["token_ids"][0] != greedy[0]
    # clamped to [-100, 100] as vLLM's: a bias of 1e6 is a bias of 100
    huge = _complete(http, prompt=prompt, max_tokens=4, logit_bias={str(forced): 1e6}, **GREEDY)
    assert huge["choices"][0]["token_ids"] == [forced] * 4
    chat = _chat(http, max_tokens=3, logit_bias={str(forced): 100}, **GREEDY)
    assert chat["choices"][0]["token_ids"] == [forced] * 3


def test_logprobs_0_reports_the_sampled_token_at_each_position(http, oai):
    c = oai.completions.create(model=MODEL, prompt="a b c", max_tokens=5, logprobs=0, temperature=1.0, seed=4)
    lp = c.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == pytest.approx({token: value})


def test_streamed_text_offsets_are_the_whole_responses_when_a_stop_string_holds_text_back(http):
    prompt = random_prompts(1, 6, 6, VOCAB, seed=14)[0]
    body = {"prompt": prompt, "max_tokens": 20, "logprobs": 1, "stop": ["never in this text"], **GREEDY}
    whole = _complete(http, **body)["choices"][0]
    chunks = [ch["choices"][0] for ch in _stream(http, CMPL, **body)]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [o for c in chunks for o in c["logprobs"]["text_offset"]] == whole["logprobs"]["text_offset"]
    assert whole["logprobs"]["text_offset"][:2] == [0, len(whole["logprobs"]["tokens"][0])]


def test_echo_puts_the_prompt_first_with_its_logprobs(http, tokenizer, hf_models):
    text = "seven plus five is"
    ids = tokenizer(text)["input_ids"]
    plain = _complete(http, prompt=text, max_tokens=3, logprobs=2, **GREEDY)["choices"][0]
    c = _complete(http, prompt=text, max_tokens=3, logprobs=2, echo=True, **GREEDY)["choices"][0]
    assert c["text"] == text + plain["text"] and c["token_ids"] == plain["token_ids"]
    lp = c["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids] + plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # the prompt's logprobs are the model's, teacher-forced
    want = hf_logprobs(hf_models["qwen2"], ids[:1], ids[1:])
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert lp["token_logprobs"][len(ids):] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])  # the token's own entry and the 2 most likely
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # echo without logprobs: the text only
    bare = _complete(http, prompt=ids, max_tokens=3, echo=True, **GREEDY)["choices"][0]
    assert bare["text"] == tokenizer.decode(ids) + plain["text"] and bare["logprobs"] is None


def test_echo_with_max_tokens_0_scores_the_prompt_alone(http, oai, tokenizer):
    text = "the cat sat on"
    ids = tokenizer(text)["input_ids"]
    r = oai.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == text and c.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert c.logprobs.token_logprobs[0] is None and all(v < 0 for v in c.logprobs.token_logprobs[1:])
    assert c.token_ids == [] and r.usage.completion_tokens == 0 and c.finish_reason == "length"
    streamed = [ch.choices[0] for ch in oai.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True,
                                                                 logprobs=1, stream=True)]
    assert "".join(s.text for s in streamed) == text
    joined = [v for s in streamed for v in s.logprobs.token_logprobs]
    assert joined[0] is None and joined[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)


def test_a_streamed_echo_is_the_whole_one_in_pieces(http):
    body = {"prompt": ["one two", "three"], "n": 2, "max_tokens": 6, "logprobs": 1, "echo": True,
            "stop": ["zz"], **GREEDY}
    whole = {c["index"]: c for c in _complete(http, **body)["choices"]}
    pieces: dict[int, list] = {}
    for ch in _stream(http, CMPL, **body):
        for c in ch["choices"]:
            pieces.setdefault(c["index"], []).append(c)
    assert sorted(pieces) == sorted(whole) == [0, 1, 2, 3]
    for i, ps in pieces.items():
        assert "".join(p["text"] for p in ps) == whole[i]["text"]
        joined = {key: [v for p in ps for v in p["logprobs"][key]] for key in whole[i]["logprobs"]}
        assert joined["tokens"] == whole[i]["logprobs"]["tokens"]
        assert joined["text_offset"] == whole[i]["logprobs"]["text_offset"]
        assert joined["token_logprobs"][0] is None  # another batch: the same values to rounding
        assert joined["token_logprobs"][1:] == pytest.approx(whole[i]["logprobs"]["token_logprobs"][1:], abs=1e-4)


def test_min_tokens_allowed_token_ids_and_bad_words_on_both_endpoints(http, tokenizer):
    prompt = random_prompts(1, 6, 6, VOCAB, seed=31)[0]
    greedy = _complete(http, prompt=prompt, max_tokens=6, **GREEDY)["choices"][0]["token_ids"]
    # min_tokens: a stop token is masked until then
    stopped = _complete(http, prompt=prompt, max_tokens=6, stop_token_ids=[greedy[0]], temperature=0)["choices"][0]
    assert stopped["token_ids"] == [greedy[0]] and stopped["finish_reason"] == "stop"
    held = _complete(http, prompt=prompt, max_tokens=6, min_tokens=4, stop_token_ids=[greedy[0]],
                     temperature=0)["choices"][0]
    assert len(held["token_ids"]) >= 4 and greedy[0] not in held["token_ids"][:4]
    allowed = [5, 77, 901]
    for out in (_complete(http, prompt=prompt, max_tokens=8, allowed_token_ids=allowed, temperature=1.0, seed=1),
                _chat(http, max_tokens=8, allowed_token_ids=allowed, temperature=1.0, seed=1)):
        assert set(out["choices"][0]["token_ids"]) <= set(allowed), out
    # bad_words: the first greedy token that is a word of its own (its text encodes to it alone)
    i, t = next((i, t) for i, t in enumerate(greedy)
                if [t] in SamplingParams(bad_words=[tokenizer.decode([t])]).bad_words_token_ids(tokenizer))
    banned = _complete(http, prompt=prompt, max_tokens=6, bad_words=[tokenizer.decode([t])], **GREEDY)
    banned = banned["choices"][0]["token_ids"]
    assert banned[:i] == greedy[:i] and t not in banned
    chat_greedy = _chat(http, max_tokens=4, **GREEDY)["choices"][0]["token_ids"]
    chat_min = _chat(http, max_tokens=4, min_tokens=3, stop_token_ids=[chat_greedy[0]], temperature=0)
    assert len(chat_min["choices"][0]["token_ids"]) >= 3


def test_masked_tokens_logprobs_are_written_as_vllm_writes_minus_infinity(http):
    """Tokens allowed_token_ids masks have logprob -inf, which JSON cannot carry: -9999.0."""
    lp = _complete(http, prompt="x", max_tokens=3, allowed_token_ids=[5, 77], logprobs=4, temperature=1.0,
                   seed=2)["choices"][0]["logprobs"]
    values = [v for top in lp["top_logprobs"] for v in top.values()]
    assert -9999.0 in values and all(v >= -9999.0 for v in values)
    chat = _chat(http, max_tokens=3, allowed_token_ids=[5, 77], logprobs=True, top_logprobs=4, temperature=1.0)
    alts = [a["logprob"] for t in chat["choices"][0]["logprobs"]["content"] for a in t["top_logprobs"]]
    assert len(alts) == 12 and -9999.0 in alts


def test_a_bug_is_a_500_for_its_request_alone_and_the_connection_stays_open():
    """The front's last resort (limits.Crashes) on a real uvicorn: before it, Starlette answered
    500 and re-raised, and uvicorn closed the client's kept-alive connection."""
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI, Request

    from rollout.sidecar.openai_front.limits import Crashes

    app = FastAPI()
    app.add_middleware(Crashes)

    @app.get("/bug")
    async def bug():
        raise RuntimeError("a bug")

    @app.get("/port")
    async def port(request: Request):
        return request.client.port  # the client's end: the same port, the same connection

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        with httpx.Client(base_url=url, timeout=10) as c:
            before = c.get("/port").json()
            r = c.get("/bug")
            assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
            assert c.get("/port").json() == before
    finally:
        server.should_exit = True
        thread.join(10)
