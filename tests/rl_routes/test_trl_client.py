"""TRL's own vLLM client (`trl.generation.vllm_client.VLLMClient`, TRL 1.16: what GRPOTrainer's
server mode calls) against the sidecar's HTTP front with vLLM's routes: it connects, generates with
token ids and logprobs and parses them as it does for `vllm serve`, reads the server info and world
size it checks, and resets the prefix cache after a sync. Its weight sync is NCCL's, which TRL runs
on CUDA only: tests/gpu/test_vllm_nccl_group.py drives that with vLLM's trainer."""

import math

import pytest

pytest.importorskip("vllm")
trl_client = pytest.importorskip("trl.generation.vllm_client")

from engine import SamplingParams  # noqa: E402
from rollout import RolloutClient  # noqa: E402
from tests.engine.helpers import hf_greedy, random_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_trls_client_generates_and_parses_our_answers(sidecar, qwen2_dir, hf_models):
    client = trl_client.VLLMClient(base_url=sidecar.http_url, connection_timeout=60)
    prompts = random_prompts(3, 4, 12, 2000, seed=41)
    greedy = client.generate(prompts, n=1, temperature=0.0, max_tokens=6, logprobs=0,
                             generation_kwargs={"ignore_eos": True})
    assert greedy["prompt_ids"] == prompts
    assert greedy["completion_ids"] == [hf_greedy(hf_models["qwen2"], p, 6, ignore_eos=True) for p in prompts]
    # logprobs=0: the sampled token's alone, under its id (TRL reads "token_id:<id>")
    assert greedy["logprob_token_ids"] == [[[t] for t in c] for c in greedy["completion_ids"]]
    assert all(lp[0] <= 0 and math.isfinite(lp[0]) for seq in greedy["logprobs"] for lp in seq)

    sampled = client.generate(prompts[:2], n=3, temperature=1.0, top_k=0, max_tokens=5, logprobs=2,
                              generation_kwargs={"ignore_eos": True, "seed": 7})
    assert len(sampled["prompt_ids"]) == 2 and len(sampled["completion_ids"]) == 6  # prompt-major, as vLLM's
    for ids, lps, tops in zip(sampled["completion_ids"], sampled["logprobs"], sampled["logprob_token_ids"]):
        assert len(ids) == len(lps) == len(tops) == 5
        for t, lp, top in zip(ids, lps, tops):
            assert t in top and 2 <= len(top) <= 3 and lp == sorted(lp, reverse=True)

    info = client.get_server_info()
    assert info["weight_transfer_config"] is not None and info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert client.get_world_size() == 1
    client.reset_prefix_cache()

    ours = RolloutClient(sidecar.url)  # the same sidecar still serves our own client
    try:
        [[r]] = ours.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert r.token_ids == greedy["completion_ids"][0]
    finally:
        ours.close()
