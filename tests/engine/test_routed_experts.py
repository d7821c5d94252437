"""Routed experts (SamplingParams.return_routed_experts): every computed position's top-k expert ids
per MoE layer, as HF's router chooses them on the same tokens, compact, from the prompt start asked
for; a dense model refuses the request by name and goes on serving."""

import numpy as np
import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from tests.engine.helpers import random_prompts

U = 2.0**-24


def _hf_choices(hf, ids: list[int]):
    """HF's per-layer top-k expert ids [T, layers, k], and per position and layer the router-logit gap
    between the k-th and (k+1)-th choice against the bound on how far the engine's logits may be
    from HF's: fp32 roundings through every layer before (attention over T, the MLPs' widths) times
    the router's absolute products."""
    cfg = hf.config
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), output_router_logits=True, output_hidden_states=True)
    k = cfg.num_experts_per_tok
    width = cfg.hidden_size + getattr(cfg, "moe_intermediate_size", cfg.intermediate_size) * k + len(ids)
    chosen, decided = [], []
    for layer, logits in enumerate(out.router_logits):
        logits = logits.view(len(ids), -1).double()
        top = logits.topk(k + 1, dim=-1)
        chosen.append(top.indices[:, :k])
        h = out.hidden_states[layer][0].double()  # the layer's input: its normed value is within 1 of it, by scale
        gate = hf.model.layers[layer].mlp.gate.weight.double()
        mag = (h.abs() / h.pow(2).mean(-1, keepdim=True).sqrt()) @ gate.abs().t()
        bound = (layer + 1) * width * U * mag.max(-1).values
        decided.append(top.values[:, k - 1] - top.values[:, k] > 2 * bound)
    return torch.stack(chosen, 1).numpy(), torch.stack(decided, 1).numpy()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_routed_ids_are_hfs_router_top_k(arch, moe_dirs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_dirs[arch], dtype=torch.float32).eval()
    llm = LLM(EngineConfig(model=moe_dirs[arch], max_model_len=256))
    prompts = random_prompts(4, 5, 30, 2000, seed=7)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, return_routed_experts=True)
    checked = total = 0
    for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        c = o.outputs[0]
        got = c.routed_experts
        assert got.dtype == np.uint8 and got.shape == (len(p) + len(c.token_ids) - 1, 4, 2)
        assert c.routed_experts_versions == [0] * len(got)
        want, decided = _hf_choices(hf, p + c.token_ids[:-1])
        assert (got == want)[decided].all()
        checked, total = checked + decided.all(-1).sum(), total + decided.size
    assert checked >= 0.9 * total / 4  # rows decided in every layer: the comparison is not vacuous


def test_prompt_start_and_streamed_rows(moe_dirs):
    llm = LLM(EngineConfig(model=moe_dirs["qwen2_moe"], max_model_len=256))
    prompt = random_prompts(1, 12, 12, 2000, seed=3)[0]
    whole = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  return_routed_experts=True), use_tqdm=False)[0].outputs[0]
    tail = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_routed_experts=True,
                                                 routed_experts_prompt_start=9), use_tqdm=False)[0].outputs[0]
    none = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_routed_experts=True,
                                                 routed_experts_prompt_start=12), use_tqdm=False)[0].outputs[0]
    assert whole.routed_experts.shape[0] == 12 + 5
    assert np.array_equal(tail.routed_experts, whole.routed_experts[9:])
    assert np.array_equal(none.routed_experts, whole.routed_experts[12:])
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert plain[0].outputs[0].routed_experts is None and plain[0].outputs[0].token_ids == whole.token_ids


def test_a_dense_model_refuses_by_name_and_serves_on(qwen2_dir):
    llm = LLM(EngineConfig(model=qwen2_dir, max_model_len=128))
    with pytest.raises(ValueError, match="return_routed_experts.*no mixture-of-experts layers"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, return_routed_experts=True), use_tqdm=False)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_bad_routing_fields_fail_the_request():
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        SamplingParams(routed_experts_prompt_start=-1)
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts="yes")


def test_the_async_engine_streams_the_rows_from_its_core_process(moe_dirs, loop):
    """Across the core's socket (msgpack): delta outputs carry the new rows of the tokens they bring (a
    consumer that falls behind gets steps merged, rows and tokens alike), which add up to the offline
    engine's array; a dense-model-style refusal is not triggered on an MoE."""
    from engine import AsyncEngine

    d = moe_dirs["olmoe"]
    prompt = random_prompts(1, 9, 9, 2000, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, return_routed_experts=True)
    offline = LLM(EngineConfig(model=d, max_model_len=128)).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    engine = AsyncEngine(EngineConfig(model=d, max_model_len=128))
    try:
        async def stream():
            parts = []
            async for out in engine.generate(prompt, SamplingParams(**{**params.__dict__, "output_kind": "delta"}),
                                             request_id="r"):
                parts.append((len(out.outputs[0].token_ids), out.outputs[0].routed_experts))
            return parts

        parts = loop.run_until_complete(stream())
    finally:
        engine.shutdown()
    # The k-th token is sampled from the forward of position len(prompt) + k - 2: the first brings the
    # prompt's rows, each later one the row of the token before it.
    tokens = np.cumsum([n for n, _ in parts])
    rows = np.cumsum([0 if r is None else r.shape[0] for _, r in parts])
    assert tokens[-1] == 5 and list(rows) == [len(prompt) - 1 + t for t in tokens]
    assert np.array_equal(np.concatenate([r for _, r in parts if r is not None]), offline.routed_experts)
