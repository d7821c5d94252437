"""An int8 sidecar (`rollout.serve --quantization int8`) fed fp32 or bf16 pushes: the weights it holds
are the trainer's (checksums), it serves what a fresh int8 engine on the saved checkpoint serves
(greedy tokens and logprobs), deltas stay exact, and health, /server_info and the push reply say
what it serves."""

import copy
import re
import subprocess
import sys

import httpx
import pytest
from transformers import AutoTokenizer

from engine import LLM, EngineConfig, SamplingParams
from rollout import RolloutClient
from tests.rollout.sidecar import TOKEN, Sidecar
from tests.rollout.test_delta_sidecar import _step
from tests.rollout.test_sidecar import perturb

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _fresh_int8(trainer, tmp_path, dtype: str) -> LLM:
    trainer.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(trainer.name_or_path).save_pretrained(tmp_path)
    return LLM(EngineConfig(model=str(tmp_path), dtype=dtype, max_model_len=128, quantization="int8"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_int8_sidecar_holds_the_trainers_weights_and_serves_their_int8_policy(qwen2_dir, hf_models, tmp_path, dtype):
    sidecar = Sidecar(qwen2_dir, "--num-engines", "1", "--quantization", "int8", "--max-model-len", "128",
                      "--dtype", dtype, "--http-port", "0", "--weight-transfer-routes")
    client = RolloutClient(sidecar.url, token=TOKEN)
    trainer = copy.deepcopy(hf_models["qwen2"])
    try:
        health = client.health()
        assert health["quantization"] == "int8" and health["quantized_bytes"] > 0
        info = httpx.get(sidecar.http_url + "/server_info?config_format=json", timeout=30,
                         headers={"Authorization": f"Bearer {TOKEN}"}).json()["vllm_config"]["model_config"]
        assert info["quantization"] == "int8" and info["quantized_bytes"] == health["quantized_bytes"]
        client.init_weight_sync()
        perturb(trainer, seed=1)
        out = client.push_weights(trainer, version=1)
        [reply] = out["sidecars"]
        assert not out["delta"] and reply["quantization"] == "int8" and reply["quantized_bytes"] == health["quantized_bytes"]
        assert client.weights_checksums() == [client.checksum_of(trainer)]  # the full-precision truth

        served = client.generate(PROMPTS, GREEDY)
        fresh = _fresh_int8(trainer, tmp_path, dtype).generate(PROMPTS, GREEDY, use_tqdm=False)
        for [rollout], want in zip(served, fresh):
            assert rollout.token_ids == want.outputs[0].token_ids
            assert rollout.logprobs == pytest.approx(want.outputs[0].logprobs, abs=1e-5)

        if dtype == "float32":
            return  # the trainer keeps what it sent (a delta's base) for 2-byte weights only
        _step(trainer, 2)
        assert client.push_weights(trainer, version=2, delta=True)["delta"]
        assert client.weights_checksums() == [client.checksum_of(trainer)]  # a delta, applied exactly
    finally:
        client.close()
        sidecar.stop()


@pytest.mark.parametrize("flags, says", [
    (["--quantization", "fp8"], "fp8.*CUDA only"),
    (["--quantization", "int8", "--engine", "vllm"], "--quantization int8 needs --engine native"),
])
def test_a_quantization_the_engine_cannot_serve_is_refused_before_anything_starts(qwen2_dir, flags, says):
    done = subprocess.run([sys.executable, "-m", "rollout.serve", "--model", qwen2_dir, "--port", "0", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert re.search(says, done.stderr.strip().splitlines()[-1]), done.stderr
