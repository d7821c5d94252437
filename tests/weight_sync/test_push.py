"""Weight sync end to end: the trainer is this pytest process (or a spawned one), the engines are
real AsyncEngines whose core processes run the WeightSyncExtension; gloo on CPU. No mocks.

Two engines joined to one group with different rank offsets (as two sidecars would be) are fed
by one broadcast per bucket in every push below.
"""

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import AsyncEngine, EngineConfig, SamplingParams
from tests.engine.helpers import (
    activation_magnitude, fp32_logprob_tolerance, hf_greedy, hf_logprobs, random_prompts,
)
from weight_sync import EXTENSION, WeightSender, WeightSyncError, weights_checksum
from weight_sync.engine_side.engines import engines_checksums, join_engines, load_on_engines, receive_on_engines
from weight_sync.trainer.file_push import write_safetensors
from weight_sync.trainer.local_engines import push_to_engines
from weight_sync.trainer.weights import flatten_parameters

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 20.0  # the group's timeout for the tests that do not test timeouts


@pytest.fixture(scope="module")
def engines(qwen2_dir, loop):
    cfg = EngineConfig(model=qwen2_dir, max_num_seqs=8, max_model_len=256, kv_cache_memory_gb=0.1,
                       worker_extension_cls=EXTENSION)
    # Started from this thread: the core process gets SIGKILLed when the thread that started it ends.
    made = [AsyncEngine(cfg), AsyncEngine(cfg)]
    yield made
    for e in made:
        e.shutdown()


@pytest.fixture(scope="module")
def trainer(qwen2_dir):
    """The trainer's policy: its own copy of the checkpoint (the session-wide hf_models stay pristine)."""
    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sender():
    s = WeightSender(bucket_bytes=1 << 20, timeout_s=TIMEOUT_S)
    yield s
    s.close_group()


def run(loop, coro):
    return loop.run_until_complete(coro)


async def gather(*aws):
    return await asyncio.gather(*aws)


async def _form_group(engines, sender, timeout_s=TIMEOUT_S, **options):
    """Trainer rank 0; engine A joins as "sidecar 1" (rank offset 1), engine B as "sidecar 2"
    (rank offset 2): two separate join calls into one group of three."""
    info = sender.open_group(world_size=3, timeout_s=timeout_s)
    joined = await asyncio.gather(asyncio.to_thread(sender.join_group), join_engines(engines[:1], info, 1, **options),
                                  join_engines(engines[1:], info, 2, **options))
    return [j[0] for j in joined[1:]]


@pytest.fixture
def group(engines, sender, loop):
    """A ready group (formed again if a previous test broke or replaced it)."""
    infos = run(loop, gather(*(e.collective_rpc("weight_sync_info") for e in engines)))
    if not (sender.group is not None and sender.group.ready and all(i[0]["ready"] for i in infos)):
        run(loop, _form_group(engines, sender))
    return sender.group


def perturb(model, seed, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


async def _generate(engine, prompt, max_tokens=16):
    last = None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    async for out in engine.generate(prompt, params):
        last = out
    return last.outputs[0]


def _serves(engines, loop):
    """Every engine still answers a request."""
    outs = run(loop, gather(*(_generate(e, [5, 6, 7], 4) for e in engines)))
    assert all(len(o.token_ids) == 4 for o in outs)


# -- the happy path ----------------------------------------------------------------------------
def test_push_reaches_both_engines_exactly(engines, trainer, sender, group, loop, hf_models):
    infos = run(loop, gather(*(e.collective_rpc("weight_sync_info") for e in engines)))
    assert [i[0]["group"].split("rank ")[1].split("/")[0] for i in infos] == ["1", "2"]  # rank offsets
    prompts = random_prompts(4, 5, 30, 2000, seed=3)
    before = [hf_greedy(hf_models["qwen2"], p, 16, ignore_eos=True) for p in prompts]

    perturb(trainer, seed=1)
    result = run(loop, push_to_engines(engines, sender, trainer, version=1))
    assert result["version"] == 1 and result["bytes"] == sum(p.numel() * 4 for p in trainer.parameters())

    want = sender.checksum(trainer)
    assert want == weights_checksum(trainer.named_parameters())
    assert run(loop, engines_checksums(engines)) == [want, want]

    expected = [hf_greedy(trainer, p, 16, ignore_eos=True) for p in prompts]
    assert expected != before  # the push really changed what the model generates
    for engine in engines:
        outs = run(loop, gather(*(_generate(engine, p) for p in prompts)))
        assert [o.token_ids for o in outs] == expected
        assert all(v == 1 for o in outs for v in o.weight_versions)
        for p, o in zip(prompts, outs):
            tol = fp32_logprob_tolerance(trainer.config, activation_magnitude(trainer, p + o.token_ids))
            assert o.logprobs == pytest.approx(hf_logprobs(trainer, p, o.token_ids), abs=tol)
    # the same weights and the same batches on the same code, one request at a time: bit for bit
    alone = [[run(loop, _generate(e, p)).logprobs for p in prompts] for e in engines]
    assert alone[0] == alone[1]


def test_repeated_pushes_keep_matching(engines, trainer, sender, group, loop):
    for version in (2, 3):
        perturb(trainer, seed=version)
        run(loop, push_to_engines(engines, sender, trainer, version=version))
        assert run(loop, engines_checksums(engines)) == [sender.checksum(trainer)] * 2
    infos = run(loop, engines[0].collective_rpc("weight_sync_info"))
    assert infos[0]["version"] == 3 and infos[0]["last"]["transport"] == "broadcast"


def test_a_changed_layout_is_pushed_afresh(engines, trainer, sender, group, loop):
    """A push starts on the previous push's layout; weights that no longer fit it (here: another
    order) are refused by every rank before a byte moves, and the push runs again on their own."""
    run(loop, push_to_engines(engines, sender, trainer, version=20))
    before = sender._last_layout[1]
    perturb(trainer, seed=20)
    reordered = list(reversed(_named(trainer)))
    result = run(loop, push_to_engines(engines, sender, reordered, version=21))
    assert result["version"] == 21
    assert [t.name for t in sender._last_layout[1].tensors] == [n for n, _ in reordered]
    assert [t.name for t in before.tensors] == [n for n, _ in _named(trainer)]
    assert run(loop, engines_checksums(engines)) == [sender.checksum(trainer)] * 2


def test_unreadable_weights_are_refused_by_every_rank(engines, trainer, sender, group, loop):
    """The workers may hold the manifest before the trainer finds it cannot read the weights: it
    still votes, so they refuse at once instead of waiting out the group's timeout."""
    run(loop, push_to_engines(engines, sender, trainer, version=30))  # a layout to start the next push on
    before = run(loop, engines_checksums(engines))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="cannot be read: TypeError") as err:
        run(loop, push_to_engines(engines, sender, _named(trainer)[:-1] + [("model.norm.weight", "oops")], version=31))
    assert err.value.refused and time.monotonic() - t0 < TIMEOUT_S / 2
    assert sum("refused by another rank" in r for r in err.value.reasons) == 2
    assert sender.group.ready and run(loop, engines_checksums(engines)) == before
    perturb(trainer, seed=31)
    run(loop, push_to_engines(engines, sender, trainer, version=31))
    assert run(loop, engines_checksums(engines)) == [sender.checksum(trainer)] * 2


def test_flattened_trainer_pushes_without_packing(engines, sender, group, loop, qwen2_dir):
    """flatten_parameters lays the trainer's weights out as a push does: the model computes the
    same, still trains, and its pushes send every bucket straight from that memory."""
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(ids).logits
    params = list(model.parameters())
    flat = flatten_parameters(model)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # same objects, moved storage
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == {flat.untyped_storage().data_ptr()}
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(ids).logits.sum().backward()
    opt.step()
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in model.parameters())

    sender.close_group()  # a fresh sender state: no packing buffer allocated yet
    run(loop, _form_group(engines, sender))
    run(loop, push_to_engines(engines, sender, model, version=11))
    assert sender._buckets.buffers == [None, None]  # nothing was packed
    assert run(loop, engines_checksums(engines)) == [sender.checksum(model)] * 2
    unflat = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    run(loop, push_to_engines(engines, sender, unflat, version=12))
    assert sender._buckets.buffers != [None, None]  # the control: separate tensors are packed
    assert run(loop, engines_checksums(engines)) == [sender.checksum(unflat)] * 2


# -- refusals ----------------------------------------------------------------------------------
def _named(trainer):
    return [(n, p.detach()) for n, p in trainer.named_parameters()]


def _wrong_shape(trainer):
    named = _named(trainer)
    named[3] = (named[3][0], torch.zeros(7, 3))
    return named, f"{named[3][0]} [7, 3]"


def _unknown(trainer):
    return _named(trainer) + [("model.layers.99.mlp.up_proj.weight", torch.zeros(2, 2))], "model.layers.99"


def _missing(trainer):
    named = _named(trainer)
    del named[-1]  # model.norm.weight
    return named, "missing names (a push must cover every parameter) (1): model.norm.weight"


@pytest.mark.parametrize("case", [_wrong_shape, _unknown, _missing])
def test_bad_manifest_is_refused_and_changes_nothing(engines, trainer, sender, group, loop, case):
    before = run(loop, engines_checksums(engines))
    named, expect = case(trainer)
    with pytest.raises(WeightSyncError) as err:
        run(loop, push_to_engines(engines, sender, named, version=100))
    assert err.value.refused
    assert expect in str(err.value)
    assert sum("weight push refused, nothing changed" in r for r in err.value.reasons) == 2  # both workers
    assert run(loop, engines_checksums(engines)) == before
    _serves(engines, loop)
    assert sender.group.ready  # a refusal moves no byte: the group stays usable
    infos = run(loop, engines[0].collective_rpc("weight_sync_info"))
    assert infos[0]["ready"] and infos[0]["version"] != 100


def test_dtype_policy_and_tied_alias(engines, trainer, sender, group, loop):
    before = run(loop, engines_checksums(engines))
    named = _named(trainer)
    ints = [(n, t.to(torch.int32)) if "norm" in n else (n, t) for n, t in named]
    with pytest.raises(WeightSyncError, match="int32 -> float32"):
        run(loop, push_to_engines(engines, sender, ints, version=100))
    both = named + [("lm_head.weight", named[0][1].clone())]
    with pytest.raises(WeightSyncError, match=r"lm_head.weight \(tied to model.embed_tokens.weight\)"):
        run(loop, push_to_engines(engines, sender, both, version=100))
    assert run(loop, engines_checksums(engines)) == before

    # The tied embedding may come under its other name.
    perturb(trainer, seed=4)
    alias = [("lm_head.weight" if n == "model.embed_tokens.weight" else n, t) for n, t in _named(trainer)]
    run(loop, push_to_engines(engines, sender, alias, version=4))
    assert run(loop, engines_checksums(engines)) == [sender.checksum(trainer)] * 2

    # bf16 on the wire into fp32 parameters: the documented float -> float cast.
    sender.dtype = torch.bfloat16
    try:
        perturb(trainer, seed=5)
        result = run(loop, push_to_engines(engines, sender, trainer, version=5))
    finally:
        sender.dtype = None
    assert result["bytes"] == sum(p.numel() * 2 for p in trainer.parameters())
    rounded = [(n, p.detach().to(torch.bfloat16).float()) for n, p in trainer.named_parameters()]
    assert run(loop, engines_checksums(engines)) == [weights_checksum(rounded)] * 2
    assert weights_checksum(rounded) != sender.checksum(trainer)


# -- the file fallback -------------------------------------------------------------------------
def test_safetensors_path_gives_the_same_weights(engines, trainer, sender, group, loop, tmp_path):
    perturb(trainer, seed=6)
    manifest = write_safetensors(trainer, tmp_path / "v6", version=6)
    assert sorted(os.listdir(tmp_path / "v6")) == ["manifest.json", "weights.safetensors"]
    assert manifest.version == 6 and "lm_head.weight" not in manifest.names  # tied: written once
    run(loop, push_to_engines(engines, sender, trainer, version=6))
    over_group = run(loop, engines_checksums(engines))
    assert over_group == [sender.checksum(trainer)] * 2

    perturb(trainer, seed=7)
    run(loop, push_to_engines(engines, sender, trainer, version=7))
    result = run(loop, load_on_engines(engines[:1], str(tmp_path / "v6"), version=6))
    assert result["worker_results"][0]["transport"] == "safetensors"
    after = run(loop, engines_checksums(engines))
    assert after[0] == over_group[0]  # file path == process-group path, bit for bit
    assert after[1] == sender.checksum(trainer) != after[0]
    out = run(loop, _generate(engines[0], [9, 10, 11], 3))
    assert out.weight_versions == [6, 6, 6]

    # Refusals on the file path change nothing either.
    bad = [(n, torch.zeros(2, 2) if i == 5 else p.detach()) for i, (n, p) in enumerate(trainer.named_parameters())]
    write_safetensors(bad, tmp_path / "bad", version=8)
    os.makedirs(tmp_path / "incomplete")
    for path, match in ((tmp_path / "bad", "wrong shapes"), (tmp_path / "incomplete", "manifest.json is missing")):
        with pytest.raises(WeightSyncError, match=match):
            run(loop, load_on_engines(engines[:1], str(path), version=8))
    assert run(loop, engines_checksums(engines))[0] == over_group[0]


# -- failures mid-transfer ---------------------------------------------------------------------
def test_stalled_trainer_times_out_and_the_next_push_succeeds(engines, trainer, sender, loop):
    timeout_s = 2.0
    run(loop, _form_group(engines, sender, timeout_s=timeout_s))
    before = run(loop, engines_checksums(engines))
    perturb(trainer, seed=8)
    resume = threading.Event()

    def stall(k, n):
        if k == 3:
            resume.wait(30)

    sender.bucket_bytes = 256 * 1024
    try:
        prepared = sender.prepare(trainer, version=8)
        assert len(prepared.manifest.buckets) > 6
        send = loop.run_in_executor(None, sender.send, prepared, stall)
        t0 = time.monotonic()
        results = run(loop, receive_on_engines(engines, prepared.manifest))
        waited = time.monotonic() - t0
        resume.set()
        with pytest.raises(WeightSyncError, match="group is closed"):
            run(loop, send)
    finally:
        sender.bucket_bytes = 1 << 20
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert all("Nothing was committed" in str(r) and "still serving" in str(r) for r in results)
    assert timeout_s * 0.9 < waited < timeout_s + 8
    assert run(loop, engines_checksums(engines)) == before
    _serves(engines, loop)
    infos = run(loop, gather(*(e.collective_rpc("weight_sync_info") for e in engines)))
    assert not any(i[0]["ready"] for i in infos)  # the broken group was torn down

    # Pushing into a torn-down group fails at once (no trainer left waiting in a vote) ...
    with pytest.raises(WeightSyncError, match="no weight-sync group"):
        run(loop, push_to_engines(engines, sender, trainer, version=8))
    # ... and so does pushing to more engines than the trainer's group holds (group still usable) ...
    info = sender.open_group(world_size=2)
    run(loop, gather(asyncio.to_thread(sender.join_group), join_engines(engines[:1], info, 1)))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="has 1 workers but the 2 engines given have 2") as err:
        run(loop, push_to_engines(engines, sender, trainer, version=8))
    assert err.value.refused and time.monotonic() - t0 < 2
    assert run(loop, engines_checksums(engines)) == before
    # ... and pushing to an engine that left the group: it calls the push off before the vote,
    # and the engine that did get ready is let go at once.
    run(loop, _form_group(engines, sender))
    run(loop, engines[1].collective_rpc("close_weight_sync"))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="called off.*engine 1: RuntimeError: no weight-sync group"):
        run(loop, push_to_engines(engines, sender, trainer, version=8))
    assert time.monotonic() - t0 < 2
    assert run(loop, engines_checksums(engines)) == before  # engine 0 did not commit alone
    assert sender.group is None  # closed: engine 0 was waiting in the vote

    run(loop, _form_group(engines, sender))
    run(loop, push_to_engines(engines, sender, trainer, version=8))
    assert run(loop, engines_checksums(engines)) == [sender.checksum(trainer)] * 2


class _Trainer:
    """A trainer subprocess (tests/weight_sync/trainer_proc.py), read line by line."""

    def __init__(self, model_dir, mode, world_size, timeout_s):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.weight_sync.trainer_proc", "--model", model_dir, "--mode", mode,
             "--world-size", str(world_size), "--timeout", str(timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])},
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict):
                self.lines.put(msg)
        self.lines.put(None)

    async def next(self, key, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines.get_nowait()
            except queue.Empty:
                assert time.monotonic() < deadline, f"trainer process sent no {key!r}"
                await asyncio.sleep(0.02)
                continue
            assert msg is not None, f"trainer process exited (code {self.proc.poll()}) before sending {key!r}"
            if key in msg:
                return msg

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_killed_trainer_mid_transfer(engines, trainer, sender, loop, qwen2_dir):
    timeout_s = 20.0
    before = run(loop, engines_checksums(engines))
    proc = _Trainer(qwen2_dir, "stall", world_size=3, timeout_s=timeout_s)
    try:
        async def scenario():
            info = (await proc.next("info"))["info"]
            await asyncio.gather(join_engines(engines[:1], info, 1), join_engines(engines[1:], info, 2))
            manifest = (await proc.next("manifest"))["manifest"]
            receiving = asyncio.ensure_future(receive_on_engines(engines, json.loads(manifest)))
            await proc.next("stalled")
            await asyncio.sleep(0.3)  # the workers are blocked mid-transfer
            assert not receiving.done()
            os.kill(proc.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            results = await receiving
            return results, time.monotonic() - t0

        results, recovered_in = run(loop, scenario())
    finally:
        proc.close()
    assert all(isinstance(r, RuntimeError) and "Nothing was committed" in str(r) for r in results), results
    assert recovered_in < timeout_s  # a dead peer is noticed at once, not at the timeout
    assert run(loop, engines_checksums(engines)) == before  # the previous version, whole
    _serves(engines, loop)

    run(loop, _form_group(engines, sender))
    perturb(trainer, seed=9)
    run(loop, push_to_engines(engines, sender, trainer, version=9))
    assert run(loop, engines_checksums(engines)) == [sender.checksum(trainer)] * 2


def test_ddp_and_dtensor_trainer_with_its_own_default_group(engines, loop, qwen2_dir):
    """A trainer with its own default process group pushes a DDP-wrapped model, then
    DTensor-sharded weights (gathered with full_tensor); its default group still works after."""
    proc = _Trainer(qwen2_dir, "ddp", world_size=2, timeout_s=TIMEOUT_S)
    try:
        async def scenario():
            info = (await proc.next("info"))["info"]
            await join_engines(engines[:1], info, 1)
            checks = []
            for _ in range(2):
                proc.go()
                msg = await proc.next("manifest")
                (result,) = await receive_on_engines(engines[:1], json.loads(msg["manifest"]))
                assert not isinstance(result, BaseException), result
                await proc.next("sent")
                checks.append((msg["checksum"], (await engines_checksums(engines[:1]))[0]))
            return checks, await proc.next("default_group_ok")

        checks, final = run(loop, scenario())
    finally:
        proc.close()
    assert all(want == got for want, got in checks)
    assert checks[0][0] != checks[1][0]
    assert final["default_group_ok"] and final["default_world"] == 1


def test_keep_staging_reuses_memory_and_copy_commit(engines, trainer, sender, loop):
    """keep_staging: from the third push on, the previous weights' buffer is the next staging
    buffer; commit="copy" copies into the existing parameters. Both stay exact."""
    for keep, commit in ((True, "swap"), (True, "copy"), (False, "swap")):
        run(loop, _form_group(engines, sender, keep_staging=keep, commit=commit))
        spare = []
        for i in range(3):
            perturb(trainer, seed=20 + i)
            run(loop, push_to_engines(engines, sender, trainer, version=20 + i))
            assert run(loop, engines_checksums(engines)) == [sender.checksum(trainer)] * 2
            info = run(loop, engines[0].collective_rpc("weight_sync_info"))[0]
            assert info["keep_staging"] is keep and info["commit"] == commit
            spare.append(info["spare_bytes"])
        layout = sender.prepare(trainer, 0).manifest.layout_bytes
        if not keep:
            assert spare == [0, 0, 0]
        elif commit == "swap":  # from the 2nd push on, the previous push's buffer is the spare
            assert spare[1:] == [layout, layout]
        else:
            assert spare == [layout] * 3
    run(loop, gather(*(e.collective_rpc("close_weight_sync") for e in engines)))
    info = run(loop, engines[0].collective_rpc("weight_sync_info"))[0]
    assert info["spare_bytes"] == 0 and not info["ready"]
