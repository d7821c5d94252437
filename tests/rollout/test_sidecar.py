"""The real sidecar process, driven by the real client (CPU, gloo)."""

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import torch
import zmq

from engine import SamplingParams
from rollout import AsyncRolloutClient, RolloutClient, SidecarError
from tests.engine.helpers import hf_greedy, random_prompts
from tests.procs import descendants
from tests.rollout.in_flight import held
from tests.rollout.sidecar import TOKEN, Sidecar

pytestmark = pytest.mark.timeout(300)


def perturb(model, seed, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module")
def sidecar(qwen2_dir, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("sidecar") / "sidecar.log")  # for tests that read what it logged
    s = Sidecar(qwen2_dir, "--max-staleness", "2", "--max-stale-restarts", "1000", "--log-level", "INFO",
                log_path=log_path)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def trainer(hf_models):
    return copy.deepcopy(hf_models["qwen2"])


@pytest.fixture(scope="module")
def module_client(sidecar):
    c = RolloutClient(sidecar.url, token=TOKEN)
    yield c
    c.close()


@pytest.fixture()
def client(module_client):
    """The module's client, owning the sidecar's weight sync for this test (other tests' trainers
    took it over: one trainer owns it at a time)."""
    module_client.init_weight_sync(take_over=True)
    return module_client


def _greedy(client, prompts, max_tokens=16):
    return client.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def test_generate_push_and_match_hf(client, trainer):
    prompts = random_prompts(4, 5, 30, 2000, seed=60)
    groups = client.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1))
    assert [len(g) for g in groups] == [3] * 4
    assert all(r.prompt_token_ids == p and len(r.logprobs) == len(r.token_ids) for g, p in zip(groups, prompts)
               for r in g)
    perturb(trainer, 1)
    version = client.stats()["version"] + 1
    client.push_weights(trainer, version=version)
    assert client.weights_checksums() == [client._client.sender.checksum(trainer)]
    after = _greedy(client, prompts)
    for g, p in zip(after, prompts):
        r = g[0]
        assert r.token_ids == hf_greedy(trainer, p, 16, ignore_eos=True)
        assert r.weight_versions == [version] * 16 and r.finish_reason == "length"
    stats = client.stats()
    assert stats["version"] == version and stats["pushes"] >= 1 and stats["rollouts"] >= 16


def test_conversations_go_through_the_chat_template(client, hf_models):
    from transformers import AutoTokenizer

    conv = [{"role": "user", "content": "Name a color."}]
    groups = client.generate(conv, SamplingParams(n=2, max_tokens=5, ignore_eos=True))  # one conversation
    assert len(groups) == 1 and len(groups[0]) == 2
    tok = AutoTokenizer.from_pretrained(hf_models["qwen2"].name_or_path)
    want = list(tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert all(r.prompt_token_ids == want for r in groups[0])
    mixed = client.generate([conv, "plain text", [5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(g) for g in mixed] == [1, 1, 1] and mixed[0][0].prompt_token_ids == want


def test_generate_iter_yields_each_group(client):
    prompts = random_prompts(5, 5, 20, 2000, seed=61)
    seen = dict(client.generate_iter(prompts, [SamplingParams(n=2, max_tokens=4 + 4 * i) for i in range(5)]))
    assert sorted(seen) == list(range(5))
    assert all(len(r.token_ids) <= 4 + 4 * i for i, g in seen.items() for r in g)


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pushes_under_load_return_every_rollout_whole_once(sidecar, trainer, mode):
    prompts = random_prompts(25, 5, 40, 2000, seed=62)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=48, ignore_eos=True)

    async def run():
        client = AsyncRolloutClient(sidecar.url, token=TOKEN)
        await client.init_weight_sync(take_over=True)
        base = (await client.stats())[0]["version"]
        seen, versions_at_receipt = {}, {}
        pushed = [base]

        async def consume():
            async for idx, group in client.generate_iter(prompts, params):
                assert idx not in seen, "a group came back twice"
                seen[idx] = group
                versions_at_receipt[idx] = pushed[-1]

        async def pusher():
            for k in range(1, 11):
                await asyncio.sleep(0.05)
                await client.push_weights(trainer, version=base + k, pause_mode=mode)
                pushed.append(base + k)

        await asyncio.gather(consume(), pusher())
        stats = (await client.stats())[0]
        await client.close()
        return seen, versions_at_receipt, stats, base

    seen, at_receipt, stats, base = asyncio.new_event_loop().run_until_complete(run())
    assert sorted(seen) == list(range(25))
    rollouts = [r for g in seen.values() for r in g]
    assert len(rollouts) == 200 and sorted(r.index for r in seen[0]) == list(range(8))
    for idx, g in seen.items():
        for r in g:
            assert len(r.token_ids) == 48 and len(r.logprobs) == 48 and r.finish_reason == "length"
            assert len(r.weight_versions) == 48
            assert all(a <= b for a, b in zip(r.weight_versions, r.weight_versions[1:]))
            assert r.weight_versions[-1] - r.weight_versions[0] <= 2  # --max-staleness 2
            assert at_receipt[idx] - r.weight_versions[0] <= 3  # the sidecar's check ran before sending
            if mode != "keep":
                assert len(set(r.weight_versions)) <= 3
    assert stats["version"] == base + 10
    if mode == "abort":
        assert stats["aborted_resubmitted"] > 0


def test_a_generate_that_times_out_is_aborted_on_the_sidecar(sidecar, module_client):
    """A client whose call times out (or whose caller is cancelled) tells the sidecar, which aborts
    the call's requests: nothing keeps decoding for nobody. `timeout_s` bounds the silence between
    a call's answers, so the engine cores are held stopped while the call waits: no group can end
    before the bound whatever the machine's speed (with the work alone, 64 prompts x 4 samples x
    200 tokens, groups ended every second on a fast CPU and the call never fell silent). The work
    (128 x 4 x 240 tokens: 10 s on a fast CPU) outlasts the 3 s the abort is given by far."""
    impatient = RolloutClient(sidecar.url, token=TOKEN, timeout_s=1)
    try:
        cores = [e["pid"] for e in module_client.health()["engine_states"]]
        with held(cores), pytest.raises(TimeoutError):
            impatient.generate(random_prompts(128, 4, 8, 2000, seed=5),
                               SamplingParams(n=4, max_tokens=240, ignore_eos=True))
        deadline = time.monotonic() + 3
        while module_client.stats()["groups_in_flight"] > 0:
            assert time.monotonic() < deadline, "the sidecar is still generating for a caller that gave up"
            time.sleep(0.05)
        assert impatient.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0][0].token_ids  # still usable
    finally:
        impatient.close()


def _raw(url, payload: bytes, timeout=30):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(url)
    s.send(payload)
    while True:  # past the liveness probes the sidecar sends a client with a generate call in flight
        assert s.poll(timeout * 1000), "no reply"
        reply = msgspec.msgpack.decode(s.recv())
        if reply.get("stage") != "probe":
            break
    s.close()
    return reply


def test_bad_input_fails_alone(sidecar, client, trainer, qwen2_dir, model_dirs):
    enc = msgspec.msgpack.encode
    ok = lambda: _greedy(client, [[5, 6, 7]], 4)[0][0].finish_reason == "length"  # noqa: E731

    r = _raw(sidecar.url, b"\x00garbage")
    assert r["ok"] is False and "malformed" in r["error"]
    assert ok()
    r = _raw(sidecar.url, enc({"type": "launch_missiles", "call_id": 5}))
    assert r["ok"] is False and r["call_id"] == 5 and "malformed" in r["error"]
    assert ok()
    r = _raw(sidecar.url, enc({"type": "stats", "call_id": 6, "token": "wrong"}))
    assert r["ok"] is False and "token" in r["error"]
    r = _raw(sidecar.url, enc({"type": "stats", "call_id": 7}))
    assert r["ok"] is False and "token" in r["error"]
    assert ok()
    r = _raw(sidecar.url, enc({"type": "generate", "call_id": 8, "token": TOKEN, "prompts": [[5, 6]],
                               "params": {"top_p": 2.0}}))
    assert r["ok"] is False and "top_p" in r["error"]
    with pytest.raises(SidecarError, match="max_model_len"):
        client.generate([list(range(3, 400))], SamplingParams(max_tokens=4))
    with pytest.raises(SidecarError, match="vocabulary"):
        client.generate([[5, 6], [5, 10**7]], SamplingParams(max_tokens=4))
    assert ok()
    # a push whose manifest does not match the engine's model: refused, nothing changed
    client.init_weight_sync()  # other tests' clients may have formed newer groups
    before = _greedy(client, [[9, 10, 11]], 8)[0][0].token_ids
    version = client.stats()["version"]
    wrong = [(n, t) for n, t in trainer.state_dict().items() if "layers.0." not in n]
    with pytest.raises(SidecarError, match="refused|missing"):
        client.push_weights(wrong, version=version + 1)
    bad_shape = [(n, t[:-1] if n.endswith("norm.weight") else t) for n, t in trainer.state_dict().items()]
    with pytest.raises(SidecarError, match="wrong shapes"):  # found by the workers, on a fresh layout
        client.push_weights(bad_shape, version=version + 1)
    assert client.stats()["version"] == version
    assert _greedy(client, [[9, 10, 11]], 8)[0][0].token_ids == before
    # the group survives a refused push: a good one goes through (on the last layout every rank
    # accepted: a refused one is never started on again)
    client.push_weights(trainer, version=version + 1)
    assert client.stats()["version"] == version + 1


def test_a_refused_push_counts_once_and_the_good_push_after_it_logs_no_failure(sidecar, client, trainer):
    """Issue 36: a model with one layer fewer is refused, and counts as one failed push (its first
    attempt, on the layout the trainer reused, is the trainer's own to withdraw); the correct push
    after it commits at once, and the sidecar logs no failure for it (not the refused push's error)."""
    version = client.stats()["version"]
    client.push_weights(trainer, version=version + 1)  # a layout every rank accepted: the next push starts on it
    failed = client.stats()["failed_pushes"]
    last = trainer.config.num_hidden_layers - 1
    fewer = [(n, t) for n, t in trainer.state_dict().items() if f"layers.{last}." not in n]
    with pytest.raises(SidecarError, match="missing names") as err:
        client.push_weights(fewer, version=version + 2)
    assert err.value.kind == "refused"
    assert client.stats()["failed_pushes"] == failed + 1

    with open(sidecar.log_path) as log:
        log.seek(0, os.SEEK_END)
        client.push_weights(trainer, version=version + 2)
        logged = log.read()
    stats = client.stats()
    assert stats["version"] == version + 2 and stats["failed_pushes"] == failed + 1
    assert "failed" not in logged and "missing names" not in logged and " ERROR " not in logged, logged


TRAINER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
from rollout import RolloutClient
url, token, model, timeout = sys.argv[1:5]
client = RolloutClient(url, token=token)
client.init_weight_sync(timeout_s=float(timeout), bucket_bytes=256 * 1024, take_over=True)  # the test's client owns it
m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
with torch.no_grad():
    for p in m.parameters():
        p.mul_(1.5)
def stall(k, n):
    if k == 3:
        print(json.dumps({"stalled": k}), flush=True)
        time.sleep(3600)
client.push_weights(m, version=999, progress=stall)
"""


def test_trainer_killed_mid_push_sidecar_recovers(sidecar, client, trainer, qwen2_dir):
    before = _greedy(client, [[9, 10, 11]], 8)[0][0].token_ids
    version = client.stats()["version"]
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, sidecar.url, TOKEN, qwen2_dir, "120"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    line = proc.stdout.readline()
    assert json.loads(line) == {"stalled": 3}
    t0 = time.monotonic()
    health = client.health()  # answered at once mid-push, not after the group's timeout
    assert time.monotonic() - t0 < 2 and health["pushing"] and health["engines"] == 1
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    # not the group's timeout (120 s): the sidecar sees the trainer's port close, stops the engines
    # stuck in the transfer and restarts them with the old weights, which serve again
    assert _greedy(client, [[9, 10, 11]], 8)[0][0].token_ids == before
    assert time.monotonic() - t0 < 30  # about 1 s to notice + an engine start (~4 s idle)
    assert client.stats()["version"] == version
    # the client forms a new group (its owner, the killed trainer, is gone: no take_over needed)
    client.init_weight_sync()
    client.push_weights(trainer, version=version + 1)
    assert client.stats()["version"] == version + 1
    assert _greedy(client, [[9, 10, 11]], 8)[0][0].token_ids == hf_greedy(trainer, [9, 10, 11], 8, True)


@pytest.mark.parametrize("freeze,overlap", [  # the two freezes and both receives; the fourth pair is not in CI
    ("stalled", "on"), pytest.param("stopped", "on", marks=pytest.mark.slow), ("stopped", "off")])
def test_a_trainer_frozen_mid_push_costs_the_stall_timeout(qwen2_dir, freeze, overlap):
    """Alive, its port open, no bucket coming (stalled in its own code, or SIGSTOPped so its store
    is silent too): the sidecar gives the push up after --push-stall-timeout, not the group's
    timeout (120 s), and serves the old weights again."""
    s = Sidecar(qwen2_dir, "--push-stall-timeout", "3", "--overlap-receive", overlap)
    client = RolloutClient(s.url, token=TOKEN)
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, s.url, TOKEN, qwen2_dir, "120"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        before = _greedy(client, [[9, 10, 11]], 8)[0][0].token_ids
        assert json.loads(proc.stdout.readline()) == {"stalled": 3}
        if freeze == "stopped":
            proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert _greedy(client, [[9, 10, 11]], 8)[0][0].token_ids == before
        took = time.monotonic() - t0
        assert took < 3 + 1 + 20, took  # the stall timeout, a probe, an engine restart on a loaded machine
        while client.stats()["failed_pushes"] == 0:  # the engines may serve before the push is given up
            assert time.monotonic() - t0 < 3 + 1 + 20, "the stalled push was never given up"
            time.sleep(0.1)
        assert client.stats()["version"] == 0
    finally:
        proc.kill()
        proc.wait()
        client.close()
        s.stop()


@pytest.mark.slow  # in CI through tests/ray_cluster: one client's group of two and of four sidecars
def test_two_sidecars_one_client_one_broadcast(sidecar, qwen2_dir, trainer):
    second = Sidecar(qwen2_dir)
    try:
        client = RolloutClient([sidecar.url, second.url], token=TOKEN)
        info = client.init_weight_sync(take_over=True)  # the module's client owns the first sidecar
        assert info["world_size"] == 3 and info["rank_offsets"] == [1, 2]
        perturb(trainer, 7)
        v = max(s["version"] for s in client.stats()) + 1
        client.push_weights(trainer, version=v)
        prompts = random_prompts(6, 5, 20, 2000, seed=63)
        groups = client.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        for g, p in zip(groups, prompts):  # prompts 0-2 went to one sidecar, 3-5 to the other
            assert g[0].token_ids == hf_greedy(trainer, p, 10, ignore_eos=True)
            assert g[0].weight_versions == [v] * 10
        assert [s["version"] for s in client.stats()] == [v, v]
        client.close()
    finally:
        second.stop()


def test_sigterm_under_load_exits_cleanly(qwen2_dir):
    s = Sidecar(qwen2_dir)
    kids = descendants(s.proc.pid)
    assert kids  # the engine-core process
    client = AsyncRolloutClient(s.url, token=TOKEN)

    async def load():
        try:
            await client.generate(random_prompts(16, 5, 20, 2000, seed=64),
                                  SamplingParams(n=4, max_tokens=200, ignore_eos=True))
        except SidecarError as e:
            return str(e)

    async def in_flight():  # all 64 sequences on the engine, none finished (200 tokens each)
        while (await client.stats())[0]["queue_depth"] < 16 * 4:
            await asyncio.sleep(0.01)

    loop = asyncio.new_event_loop()
    task = loop.create_task(load())
    loop.run_until_complete(asyncio.wait_for(in_flight(), 60))
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    code = s.proc.wait(10)
    assert time.monotonic() - t0 < 10 and code == 0
    err = loop.run_until_complete(asyncio.wait_for(task, 10))
    assert err and "shutting down" in err
    loop.run_until_complete(client.close())
    loop.close()
    time.sleep(0.5)
    assert not [k for k in kids if os.path.exists(f"/proc/{k}") and open(f"/proc/{k}/stat").read().split()[2] != "Z"]


def test_sigterm_during_a_stalled_push_exits_within_10_s(qwen2_dir):
    """A trainer frozen mid-push (alive, its port open: the sidecar cannot tell it from a slow
    one) holds the engines in the transfer; SIGTERM still stops the sidecar in seconds, with
    nothing committed, instead of waiting out the group's timeout."""
    s = Sidecar(qwen2_dir)
    kids = descendants(s.proc.pid)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, s.url, TOKEN, qwen2_dir, "120"], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert json.loads(trainer.stdout.readline()) == {"stalled": 3}
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(20)
        assert time.monotonic() - t0 < 10
    finally:
        trainer.kill()
        trainer.wait()
        s.stop()
    time.sleep(0.5)
    assert not [k for k in kids if os.path.exists(f"/proc/{k}") and open(f"/proc/{k}/stat").read().split()[2] != "Z"]


def test_binding_off_loopback_needs_a_token(qwen2_dir):
    r = subprocess.run([sys.executable, "-m", "rollout.serve", "--model", qwen2_dir, "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--token" in r.stderr


def test_help_is_there():
    r = subprocess.run([sys.executable, "-m", "rollout.serve", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--pause-mode" in r.stdout and "--max-staleness" in r.stdout


def test_an_fp32_trainer_pushes_a_bf16_engine_in_bf16(qwen2_dir, trainer):
    """The engines' dtype sets the wire dtype: half the bytes of the trainer's fp32, and the
    engine holds exactly the trainer's weights rounded to bf16 (checksums in bf16 agree)."""
    from weight_sync.trainer.sender import WeightSender

    s = Sidecar(qwen2_dir, "--dtype", "bfloat16")
    try:
        with RolloutClient(s.url, token=TOKEN) as client:
            client.init_weight_sync()
            sender = client._client.sender
            assert sender.dtype is torch.bfloat16
            manifest = sender.prepare(trainer, version=1).manifest
            assert {t.dtype for t in manifest.tensors} == {"bfloat16"}
            assert manifest.total_bytes * 2 == WeightSender().prepare(trainer, version=1).manifest.total_bytes
            client.push_weights(trainer, version=1)
            assert client.weights_checksums() == [sender.checksum(trainer)]
    finally:
        s.stop()
