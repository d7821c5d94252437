"""`python -m rollout.router` (issue 66 item 2): a real router process over real sidecar processes'
HTTP fronts. Sessions stay where their prefix is and spread by load; the token rule holds; a sidecar
killed mid-session gives its sessions to the others and loses no episode, one slow to answer a poll
keeps them and a frozen one goes; a streamed call is never sent
again after its first chunk; a sidecar that comes back on older weights gets no call until its trainer's
client has caught it up."""

import concurrent.futures
import signal
import time

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from rollout import RolloutClient
from rollout.launcher import LocalRouter
from rollout.router.__main__ import parse_args as router_args
from rollout.router.session_key import session_key
from tests.procs import free_port, signal_tree
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_engine_faults import _perturbed

pytestmark = pytest.mark.timeout(300)

MODEL = "policy"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_the_session_key_is_the_header_then_the_body_then_sglang_then_the_user():
    body = {"session_id": "b", "session_params": {"id": "s"}, "user": "u"}
    assert session_key({"x-session-id": "h"}, body) == "h"
    assert session_key({}, body) == "b"
    assert session_key({}, {"session_params": {"id": "s"}, "user": "u"}) == "s"
    assert session_key({}, {"user": "u"}) == "u"
    assert session_key({}, {"prompt": "x"}) is None and session_key({}, None) is None
    for bad in (7, "", "x" * 300):
        with pytest.raises(ValueError, match="session id"):
            session_key({}, {"session_id": bad})


def test_a_router_reachable_from_other_hosts_needs_a_token(capsys):
    with pytest.raises(SystemExit):
        router_args(["--sidecars", "http://10.0.0.1:8000", "--host", "0.0.0.0"])
    assert "set --token" in capsys.readouterr().err
    assert router_args(["--sidecars", "http://10.0.0.1:8000", "--host", "0.0.0.0", "--token", "t"]).token == "t"
    with pytest.raises(SystemExit):
        router_args(["--sidecars", "http://127.0.0.1:8000", "--misses", "0"])
    assert "--misses must be >= 1" in capsys.readouterr().err


def _front(model, http_port="0", *extra):
    return Sidecar(model, "--http-port", http_port, "--served-model-name", MODEL, *extra)


@pytest.fixture(scope="module")
def two(qwen2_dir):
    a, b = _front(qwen2_dir), _front(qwen2_dir)
    router = LocalRouter([a.http_url, b.http_url], "--poll-s", "0.2", token=TOKEN)
    yield a, b, router
    router.stop()
    a.stop()
    b.stop()


def _complete(router, prompt, session=None, max_tokens=8, token=TOKEN, **extra):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if session is not None:
        headers["X-Session-ID"] = session
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(router.url + "/v1/completions", headers=headers, json=body, timeout=120)


def _metrics(url, token=TOKEN) -> dict:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _episodes(k: int) -> dict[str, list[int]]:
    return {f"episode-{j}": [5 + j, 17, 33, 2 * j + 40] * 10 for j in range(k)}  # 40 tokens: 2 full blocks


def test_sessions_stay_where_their_prefix_is_and_spread_over_the_sidecars(two):
    """Three turns of six episodes, each turn's prompt the last one plus its completion: every call of an
    episode reaches one sidecar, the episodes spread over both, and turns after the first hit the prefix
    cache for every token of the sequence left cached."""
    a, b, router = two
    texts, home = _episodes(6), {}
    hits0 = {s.http_url: _metrics(s.http_url)[("rollout_prefix_cache_total", (("engine", "0"), ("kind", "hit_tokens")))]
             for s in (a, b)}
    for turn in range(3):
        for name in reversed(texts) if turn % 2 else texts:  # another order each turn
            r = _complete(router, texts[name], session=name, max_tokens=24)
            assert r.status_code == 200, r.text
            assert home.setdefault(name, r.headers["x-routed-to"]) == r.headers["x-routed-to"]
            texts[name] = texts[name] + r.json()["choices"][0]["token_ids"]
    assert sorted(list(home.values()).count(s.http_url) for s in (a, b)) == [3, 3]
    hits = sum(_metrics(s.http_url)[("rollout_prefix_cache_total", (("engine", "0"), ("kind", "hit_tokens")))]
               - hits0[s.http_url] for s in (a, b))
    block = 16  # the engine's default block size: a turn hits the full blocks of the last turn's computed tokens
    assert hits == 6 * sum((40 + 24 * t + 24 - 1) // block * block for t in (0, 1))  # 48 + 80 tokens
    health = httpx.get(router.url + "/health", timeout=30).json()  # /health is open, as the sidecars'
    assert health["ok"] and health["moves"] == 0 and health["pinned"] >= 6
    m = _metrics(router.url)
    assert m[("rollout_router_session_moves_total", ())] == 0 and m[("rollout_router_prefix_hit_ratio", ())] > 0
    # ended sessions are dropped
    for name in [n for n, url in home.items() if url == a.http_url]:
        assert httpx.post(router.url + "/finish_session", params={"session_id": name}, headers=AUTH).status_code == 200
    after = httpx.get(router.url + "/health", timeout=30).json()
    assert after["pinned"] == health["pinned"] - 3 and after["sidecars"][a.http_url]["sessions_pinned"] == 0
    # a sidecar taken out of the rotation and put back (vllm-router's and SGLang's routes)
    assert httpx.post(router.url + "/remove_worker", params={"url": a.http_url}, headers=AUTH).status_code == 200
    assert all(_complete(router, [2, k], session="fresh").headers["x-routed-to"] == b.http_url for k in range(3))
    assert httpx.post(router.url + "/remove_worker", params={"url": a.http_url}, headers=AUTH).status_code == 404
    assert httpx.post(router.url + "/add_worker", params={"url": a.http_url}, headers=AUTH).json()["added"]
    _until(lambda: _state(router, a.http_url) == "serving", "a was not taken back")


def test_new_sessions_avoid_a_sidecar_busy_with_another_clients_work(two):
    """A trainer's long rollouts on a (over ZMQ, not through the router): the router reads a's own load
    and sends new sessions to b."""
    a, b, router = two
    zmq = RolloutClient(a.url, token=TOKEN)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            params = SamplingParams(n=2, max_tokens=250, ignore_eos=True)
            busy = pool.submit(zmq.generate, [[4, 5, 6, k] for k in range(12)], params)
            _until(lambda: httpx.get(router.url + "/health", timeout=30).json()["sidecars"][a.http_url]["groups"] >= 12,
                   "the router never saw a's load")
            placed = [_complete(router, [8, k], session=f"newcomer-{k}").headers["x-routed-to"] for k in range(6)]
            busy.result(timeout=240)
        assert placed == [b.http_url] * 6
    finally:
        zmq.close()


def test_calls_without_the_token_are_refused_by_the_router_and_by_the_sidecars(two):
    a, b, router = two
    r = _complete(router, "hello", token="")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert _complete(router, "hello", token="wrong").status_code == 401
    open_router = LocalRouter([a.http_url, b.http_url])  # no token of its own: the sidecars' rule still holds
    try:
        assert _complete(open_router, "hello", token="").status_code == 401
        r = _complete(open_router, "hello")  # the caller's token goes on to the sidecar
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 8
        assert _metrics(open_router.url)[("rollout_router_failovers_total", ())] == 0  # a 401 is not a failure
    finally:
        open_router.stop()
    for body in (b"x" * (9 << 20), iter([b"x" * (1 << 20)] * 9)):  # by its Content-Length, and chunked, as it comes
        big = httpx.post(router.url + "/v1/completions", headers=AUTH, content=body, timeout=60)
        assert big.status_code == 413 and "--max-body-mb" in big.json()["error"]["message"]
    vllm_route = httpx.post(router.url + "/inference/v1/generate", headers={**AUTH, "X-Session-ID": "tito"}, timeout=60,
                            json={"token_ids": [3, 4, 5], "sampling_params": {"max_tokens": 4, "ignore_eos": True}})
    assert vllm_route.status_code == 200 and len(vllm_route.json()["choices"][0]["token_ids"]) == 4  # vLLM's route
    bad = _complete(router, "hello", user=7)  # a session id that is not a string: 400, named
    assert bad.status_code == 400 and "session id" in bad.json()["error"]["message"]
    chat = httpx.post(router.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                            "temperature": 0, "ignore_eos": True, "stream": True, "user": "chatter"})
    events = [line[len("data: "):] for line in chat.text.splitlines() if line.startswith("data: ")]
    assert chat.status_code == 200 and events[-1] == "[DONE]"
    # a stream read late joins tokens into fewer chunks: the tokens count, not the chunks
    assert sum(len(c.get("token_ids") or []) for e in events[:-1] for c in msgspec.json.decode(e)["choices"]) == 6


def test_a_sidecar_slow_to_answer_keeps_its_sessions_and_a_frozen_one_goes(two):
    """b frozen (SIGSTOP, its engines too) until a poll of it timed out: it still serves (on loaded cores
    one late answer had sent every new session elsewhere); frozen for longer, it goes once `--misses`
    polls in a row time out, and serves again once it answers."""
    a, b, _ = two
    router = LocalRouter([a.http_url, b.http_url], "--poll-s", "0.2", "--poll-timeout-s", "0.5", "--misses", "4",
                         token=TOKEN)
    health = lambda: httpx.get(router.url + "/health", timeout=30).json()["sidecars"][b.http_url]  # noqa: E731
    try:
        _until(lambda: _state(router, b.http_url) == "serving", "b never served")
        signal_tree(b.proc.pid, signal.SIGSTOP)
        _until(lambda: health()["misses"] >= 1, "no poll of a frozen b timed out", timeout_s=30)
        signal_tree(b.proc.pid, signal.SIGCONT)
        _until(lambda: health()["misses"] == 0, "b never answered again", timeout_s=30)
        h = health()
        assert h["state"] == "serving" and not any(c.startswith("gone") for c in h["changes"]), h
        frozen_at = time.monotonic()
        signal_tree(b.proc.pid, signal.SIGSTOP)
        _until(lambda: _state(router, b.http_url) == "gone", "a frozen b never went", timeout_s=30)
        assert time.monotonic() - frozen_at >= 4 * 0.5
        reason = httpx.get(router.url + "/health", timeout=30).json()["sidecars"][b.http_url]["reason"]
        assert "4 polls in a row timed out" in reason, reason
        signal_tree(b.proc.pid, signal.SIGCONT)
        _until(lambda: _state(router, b.http_url) == "serving", "b never served again")
    finally:
        signal_tree(b.proc.pid, signal.SIGCONT)
        router.stop()


def test_a_sidecar_killed_mid_session_moves_its_sessions_and_a_stream_is_never_sent_twice(qwen2_dir):
    """A stream on b has sent its first chunk when b is SIGKILLed: the caller gets an error event, and the
    call is not sent to a (its tokens would be sampled twice). Every episode's next turn is served, b's
    sessions moved to a, once each."""
    a, b = _front(qwen2_dir), _front(qwen2_dir)
    router = LocalRouter([a.http_url, b.http_url], "--poll-s", "0.2", token=TOKEN)
    try:
        texts, home = _episodes(4), {}
        for name, text in texts.items():
            r = _complete(router, text, session=name)
            home[name] = r.headers["x-routed-to"]
            texts[name] = text + r.json()["choices"][0]["token_ids"]
        on_b = [n for n, url in home.items() if url == b.http_url]
        assert len(on_b) == 2
        requests_on_a = _metrics(a.http_url)[("http_requests_total", (("path", "/v1/completions"), ("status", "200")))]
        body = {"model": MODEL, "prompt": texts[on_b[0]], "max_tokens": 200, "ignore_eos": True, "stream": True,
                "temperature": 0}
        events = []
        with httpx.stream("POST", router.url + "/v1/completions", headers={**AUTH, "X-Session-ID": on_b[0]},
                          json=body, timeout=120) as stream:
            assert stream.headers["x-routed-to"] == b.http_url
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        signal_tree(b.proc.pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = msgspec.json.decode(events[-2])
        assert "went mid-stream" in error["error"]["message"] and len(events) < 200
        for name in texts:  # every episode's next turn, b's on a
            r = _complete(router, texts[name], session=name)
            assert r.status_code == 200 and r.headers["x-routed-to"] == a.http_url, r.text
        after = _metrics(a.http_url)[("http_requests_total", (("path", "/v1/completions"), ("status", "200")))]
        assert after - requests_on_a == 4  # the next turns only: the stream was not re-sent to a
        health = httpx.get(router.url + "/health", timeout=30).json()
        assert health["sidecars"][b.http_url]["state"] == "gone" and health["moves"] == 2
    finally:
        router.stop()
        a.stop()
        b.stop()


def test_a_sidecar_back_on_older_weights_serves_only_once_caught_up(qwen2_dir, hf_models):
    """b dies after a push of version 1 and a new b starts on its ports holding version 0: the router
    sends it nothing (every answer is version 1's) until the trainer's client has caught it up from a,
    then sessions go to it again."""
    zmq_port, http_port = str(free_port()), str(free_port())
    a, b = _front(qwen2_dir), _front(qwen2_dir, http_port, "--port", zmq_port)
    router = LocalRouter([a.http_url, b.http_url], "--poll-s", "0.2", token=TOKEN)
    client = RolloutClient([a.url, b.url], token=TOKEN)
    again = None
    try:
        client.init_weight_sync()
        client.push_weights(_perturbed(hf_models["qwen2"], 3), version=1)
        signal_tree(b.proc.pid, signal.SIGKILL)
        _until(lambda: _state(router, b.http_url) == "gone", "the router never saw b go")
        again = _front(qwen2_dir, http_port, "--port", zmq_port)
        _until(lambda: _state(router, b.http_url) == "behind", "the router never saw b come back")
        for k in range(6):  # the client's loop is idle: b is not caught up, and serves nothing
            r = _complete(router, [3, 4, 5, k], session=f"while-behind-{k}")
            assert r.status_code == 200 and r.headers["x-routed-to"] == a.http_url
            assert set(r.json()["choices"][0]["weight_versions"]) == {1}
        _until(lambda: client.health() and client.states.get(b.url) == "active", "b was not caught up")
        _until(lambda: _state(router, b.http_url) == "serving", "the router never let b serve")
        served = {_complete(router, [7, k], session=f"after-{k}").headers["x-routed-to"] for k in range(6)}
        assert b.http_url in served
        r = _complete(router, [7, 1], session="after-1")
        assert set(r.json()["choices"][0]["weight_versions"]) == {1}
    finally:
        client.close()
        router.stop()
        a.stop()
        b.stop()
        if again is not None:
            again.stop()


def _state(router, url) -> str:
    return httpx.get(router.url + "/health", timeout=30).json()["sidecars"][url]["state"]


def _until(ok, why: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, why
        time.sleep(0.1)
