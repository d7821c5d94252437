"""LoRA adapter pushes to a real sidecar (issue 16): the engine merges what it is sent into the
base it keeps, and ends up bit for bit where a merged push (merge_and_unload) would put it."""

import copy
import dataclasses
import os
import signal

import msgspec
import pytest
import torch

from engine import SamplingParams
from rollout import RolloutClient, SidecarError
from tests.engine.helpers import hf_greedy
from tests.rollout.in_flight import wait_decoding
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_engine_faults import _cores, _wait_healthy, _wait_host_copy
from tests.rollout.test_overlap import _long_rollouts
from tests.weight_sync.test_lora import TARGET_SETS, hf_merged, lora_model, randomize
from weight_sync import weights_checksum
from weight_sync.trainer.lora_push import AdapterPush, adapter_weights

pytestmark = pytest.mark.timeout(300)
PROMPT = [9, 10, 11, 12]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _greedy(client):
    r = client.generate([PROMPT], GREEDY)[0][0]
    return r.token_ids, r.logprobs


def _adapter_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for _, t in adapter_weights(model)[0])


@pytest.mark.parametrize("arch", ["qwen2", pytest.param("llama", marks=pytest.mark.slow)])  # one layout in CI
def test_adapter_pushes_land_where_merged_pushes_do(model_dirs, hf_models, arch):
    s = Sidecar(model_dirs[arch])
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        version = 0
        for k, targets in enumerate(TARGET_SETS):
            model = lora_model(hf_models[arch], targets, seed=k)
            merged = hf_merged(model)
            for again in (False, True):
                version += 1
                out = client.push_weights(model, version=version)  # mode="adapter", the default
                # the engine's weights came from a checkpoint or a merged push: the base goes once,
                # then only the adapter moves
                sent, adapter = out["trainer"]["bytes"], _adapter_bytes(model)
                assert sent == adapter if again else sent > adapter
                assert client.weights_checksums() == [weights_checksum(merged.named_parameters())]
            assert client.checksum_of(model) == weights_checksum(merged.named_parameters())
            ids, logprobs = _greedy(client)
            assert ids == hf_greedy(merged, PROMPT, 8, ignore_eos=True)
            version += 1
            client.push_weights(model, version=version, mode="merged")
            assert client.weights_checksums() == [weights_checksum(merged.named_parameters())]
            ids_m, logprobs_m = _greedy(client)
            assert ids_m == ids
            assert torch.allclose(torch.tensor(logprobs_m), torch.tensor(logprobs), rtol=0, atol=1e-5)
    finally:
        client.close()
        s.stop()


class _Tampered(AdapterPush):
    """An adapter push whose listing a bug (or a liar) changed after the checks the trainer makes."""

    def __init__(self, model, tamper):
        super().__init__(model)
        object.__setattr__(self, "tamper", tamper)

    def listing(self):
        named, spec = AdapterPush.listing(dataclasses.replace(AdapterPush(self.model), with_base=self.with_base))
        return self.tamper(named, spec)


def test_a_bad_adapter_is_refused_and_changes_nothing(qwen2_dir, hf_models):
    s = Sidecar(qwen2_dir)
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        model = lora_model(hf_models["qwen2"], ["q_proj", "v_proj"])
        client.push_weights(model, version=1)
        before, greedy = client.weights_checksums(), _greedy(client)
        q = "model.layers.0.self_attn.q_proj"

        def wrong_rank(named, spec):
            return [(n, t[:, :2] if n == q + ".lora_B" else t) for n, t in named], spec

        def unknown_module(named, spec):
            named = [(n.replace(q, "model.layers.0.self_attn.x_proj"), t) for n, t in named]
            scales = {k.replace(q, "model.layers.0.self_attn.x_proj"): v for k, v in spec.scales.items()}
            return named, msgspec.structs.replace(spec, scales=scales)

        for tamper, why in ((wrong_rank, "rank-r"), (unknown_module, "no linear layer")):
            randomize(model, 7)
            with pytest.raises(SidecarError, match=why) as e:
                client.push_weights(_Tampered(model, tamper), version=2)
            assert e.value.kind == "refused"
            assert client.weights_checksums() == before and _greedy(client) == greedy
            assert client.stats()["version"] == 1
        client.push_weights(model, version=2)  # the group is still usable
        assert client.weights_checksums() == [weights_checksum(hf_merged(model).named_parameters())]
    finally:
        client.close()
        s.stop()


def test_fifty_adapter_pushes_leave_no_drift(qwen2_dir, hf_models):
    """Each push merges from the kept base: after 50 (the adapter changing each time, as training
    does) the engine is bit for bit the merged trainer, not a sum of rounded deltas."""
    s = Sidecar(qwen2_dir)
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        model = lora_model(hf_models["qwen2"], TARGET_SETS[1])
        for version in range(1, 51):
            randomize(model, version)
            client.push_weights(model, version=version)
            if version % 10 == 0:
                assert client.weights_checksums() == [weights_checksum(hf_merged(model).named_parameters())]
        assert _greedy(client)[0] == hf_greedy(hf_merged(model), PROMPT, 8, ignore_eos=True)
        assert client.stats()["pushes"] == 50
    finally:
        client.close()
        s.stop()


def test_a_restarted_engine_gets_the_base_again(qwen2_dir, hf_models):
    """A SIGKILLed engine comes back with the merged weights (host copy) and no known base: the
    next adapter push is refused by it before any byte moves, and goes again with the base."""
    s = Sidecar(qwen2_dir)
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        model = lora_model(hf_models["qwen2"], ["q_proj", "down_proj"])
        client.push_weights(model, version=1)
        merged = weights_checksum(hf_merged(model).named_parameters())
        _wait_host_copy(client, 1)  # a kill before it is written would lose version 1 (as it should)
        os.kill(_cores(client)[0], signal.SIGKILL)
        _wait_healthy(client)
        assert client.weights_checksums() == [merged]  # caught up from the host copy
        randomize(model, 3)
        out = client.push_weights(model, version=2)
        assert out["trainer"]["bytes"] > _adapter_bytes(model)  # the base went along
        assert client.weights_checksums() == [weights_checksum(hf_merged(model).named_parameters())]
        randomize(model, 4)
        assert client.push_weights(model, version=3)["trainer"]["bytes"] == _adapter_bytes(model)
    finally:
        client.close()
        s.stop()


LONG = ([PROMPT] * 16, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))  # seconds of decoding


@pytest.mark.parametrize("lora_versions", ["0", "4"])
def test_with_unmerged_adapters_a_rollout_finishes_under_its_version(qwen2_dir, hf_models, lora_versions):
    """A keep-mode push of adapter 2 while rollouts started under adapter 1 decode: merged (0),
    they switch to 2 mid-way; unmerged (--lora-versions 4), they finish under 1, token for token
    what adapter 1 alone gives, while a new request decodes under 2."""
    import threading

    s = Sidecar(qwen2_dir, "--lora-versions", lora_versions)
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        first, second = (lora_model(hf_models["qwen2"], TARGET_SETS[1], seed=k) for k in (1, 2))
        client.push_weights(first, version=1)
        alone = {}
        _long_rollouts(s.url, alone, *LONG)  # what adapter 1 gives with no push meanwhile
        during = {}
        load = threading.Thread(target=_long_rollouts, args=(s.url, during, *LONG))
        load.start()
        wait_decoding(client, len(LONG[0]))  # every rollout decodes under adapter 1 before the push
        client.push_weights(second, version=2, pause_mode="keep")
        mixed = client.generate([PROMPT], GREEDY)[0][0]  # decodes in the same batches as the rollouts under 1
        assert load.is_alive()
        load.join()
        assert set(mixed.weight_versions) == {2} and mixed.token_ids == hf_greedy(second, PROMPT, 8, ignore_eos=True)
        versions = {v for g in during["groups"] for r in g for v in r.weight_versions}
        if lora_versions == "0":
            assert versions == {1, 2}
        else:
            assert versions == {1}
            assert [r.token_ids for r in during["groups"][0]] == [r.token_ids for r in alone["groups"][0]]
        assert client.weights_checksums() == [weights_checksum(hf_merged(second).named_parameters())]
        r = client.generate([PROMPT], GREEDY)[0][0]
        assert set(r.weight_versions) == {2}
        assert r.token_ids == hf_greedy(second, PROMPT, 8, ignore_eos=True)  # PEFT's own unmerged forward
    finally:
        client.close()
        s.stop()


@pytest.mark.parametrize("lora_versions", ["0", "2"])
def test_a_bf16_engine_takes_an_fp32_trainers_adapter(qwen2_dir, hf_models, lora_versions):
    """The usual mixed case: the factors travel in fp32 (merged: the delta in fp32, PEFT's in-place
    add rounding once to bf16; unmerged: cast to the layer's dtype, the hooks run in bf16)."""
    s = Sidecar(qwen2_dir, "--dtype", "bfloat16", "--lora-versions", lora_versions)
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        model = lora_model(hf_models["qwen2"], TARGET_SETS[1], seed=4)
        for version in (1, 2):
            randomize(model, version)
            client.push_weights(model, version=version)
            r = client.generate([PROMPT], GREEDY)[0][0]
            assert len(r.token_ids) == 8 and set(r.weight_versions) == {version}
        assert client.health()["engine_states"][0]["restarts"] == 0
        if lora_versions == "0":  # what PEFT gives merging the same (fp32) adapter into a bf16 copy of the base
            reference = lora_model(copy.deepcopy(hf_models["qwen2"]).to(torch.bfloat16), TARGET_SETS[1])
            with torch.no_grad():
                for (n, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
                    if ".lora_" in n:
                        p.copy_(q)
            assert client.weights_checksums() == [weights_checksum(hf_merged(reference).named_parameters())]
    finally:
        client.close()
        s.stop()


def test_what_cannot_go_as_an_adapter_is_refused_before_anything_moves(qwen2_dir, hf_models):
    s = Sidecar(qwen2_dir)
    client = RolloutClient(s.url, token=TOKEN)
    try:
        client.init_weight_sync()
        before = client.weights_checksums()
        with pytest.raises(ValueError, match="lora_bias"):
            client.push_weights(lora_model(hf_models["qwen2"], ["q_proj"], lora_bias=True), version=1)
        with pytest.raises(ValueError, match="shared"):
            client.push_weights(lora_model(hf_models["qwen2"], ["q_proj"]), version=1, transport="shared")
        assert client.weights_checksums() == before and client.stats()["version"] == 0
    finally:
        client.close()
        s.stop()
