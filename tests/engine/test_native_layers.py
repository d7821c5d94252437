"""engine/models/native_layers.py: a decode step's layers in one C call give the Python forward's bits
(token ids and logprobs equal, not close: the same kernels in the same order), in the bf16 engine
and the weight-only int8 one, on Llama's shape, Qwen2's (q/k/v biases), Llama 3's (scaled rope),
Qwen3's (q/k norms per head), Qwen3's with YaRN (cos and sin scaled), Mistral's and Qwen2's with sliding
windows shorter than the sequences, Gemma 3's (its own layer order, norms and GELU, a rope per layer kind),
and mixtures of experts'
sparse MLPs (their routed experts too); in fp32 (C's norm and silu where Python runs torch's) HF's
greedy tokens and its logprobs within fp32's rounding bound; what the C loop does not take (a LoRA
hook on a layer, the switch off) runs in Python."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import amx_linears, bf16_rows, f32_linears, int8_linears, packed_linears
from engine.models import native_layers
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance, hf_greedy, hf_logprobs, random_prompts

BF16_KERNELS = amx_linears.available() or bf16_rows.avx512_bf16()
# the bf16 loop's linears: bf16 kernels, or (AVX2: no bf16 kernels in oneDNN) our fp32 kernel on bf16 panels
bf16_loop = pytest.mark.skipif(
    not (BF16_KERNELS or (packed_linears.compute_dtype(torch.bfloat16) == torch.float32 and f32_linears.available())),
    reason="no AMX tiles, AVX512-BF16 or AVX2 fp32 kernel: the bf16 C loop has no linears here")
f32_kernel = pytest.mark.skipif(not f32_linears.available(),
                                reason="no AVX-512 or AVX2: the fp32 C loop needs its linears")
# the bf16 sparse block's experts: AMX tiles, AVX512-BF16, or (AVX2) fp32 dot products on the bf16 weights
bf16_sparse = pytest.mark.skipif(
    not (BF16_KERNELS or f32_linears.available()),
    reason="no AMX tiles, AVX512-BF16 or AVX2: the C loop's sparse block has no bf16 kernels")


@pytest.fixture(scope="module")
def dirs(model_dirs, variant_dirs, tiny_dirs):
    """The tiny families and their variants (Qwen3 with YaRN: cos and sin scaled too; sliding windows),
    Gemma 3 (its own layer order, norms, GELU and a rope table per layer kind) and Phi-3 (q/k/v and gate/up
    one linear each in the checkpoint, every layer's window 32 keys)."""
    return {**model_dirs, **variant_dirs, "gemma3": tiny_dirs["gemma3"], "phi3": tiny_dirs["phi3"]}


@pytest.fixture
def calls(monkeypatch):
    """How many decode steps ran in the C loop."""
    seen = {"native": 0}
    real = native_layers.decode

    def counted(*args):
        out = real(*args)
        seen["native"] += out is not None
        return out

    monkeypatch.setattr(native_layers, "decode", counted)
    return seen


def _plain(entry):
    """A step's logprobs as plain values (a dict of Logprob objects, or a bare float)."""
    return {k: v.logprob for k, v in entry.items()} if isinstance(entry, dict) else entry


def _run(llm: LLM, monkeypatch, switch: str):
    monkeypatch.setenv(native_layers.ENV_SWITCH, switch)
    prompts = random_prompts(5, 3, 40, 400, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=11, max_tokens=12, logprobs=0, ignore_eos=True)]
    outs = []
    for p in params:
        for o in llm.generate(prompts, p, use_tqdm=False):
            c = o.outputs[0]
            outs.append((c.token_ids, [_plain(d) for d in c.logprobs]))
    return outs


@bf16_loop
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3", "qwen3", "qwen3_yarn", "mistral_window", "qwen2_window",
                                  "gemma3", "phi3"])
@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "none"), ("bfloat16", "int8"), ("float32", "int8")])
def test_the_c_loop_gives_the_python_forwards_tokens_and_logprobs(dirs, monkeypatch, calls, arch, dtype,
                                                                  quantization):
    """bf16 (on AMX tiles, AVX512-BF16, or AVX2's fp32 kernel on bf16 panels), and int8 fed bf16 or fp32 (whose
    fp32 norm and silu run in C in both loops; weight-only int8 on AMX tiles, AVX512-BF16 or AVX2)."""
    if quantization == "int8" and (int8_linears.kernel() or ("",))[0] not in int8_linears.WEIGHT_ONLY:
        pytest.skip("no weight-only int8 kernel here (AMX tiles, AVX512-BF16 or AVX2)")
    llm = LLM(EngineConfig(model=dirs[arch], dtype=dtype, max_num_seqs=8, max_model_len=256,
                           quantization=quantization))
    # NOTE: the first generate prefills the prompts fresh, the later ones on their cached prefixes,
    # whose attention rounds differently in bf16 (0.01-0.03 on a logprob): compare two of the later ones
    _run(llm, monkeypatch, "0")
    calls["native"] = 0
    python = _run(llm, monkeypatch, "0")
    assert calls["native"] == 0
    native = _run(llm, monkeypatch, "1")
    assert calls["native"] > 0  # qwen2's q/k/v biases too, on an int8 copy added after its rounding
    assert native == python


@bf16_sparse
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_the_c_loop_runs_sparse_layers_with_the_python_forwards_bits_and_routing(moe_dirs, monkeypatch, calls, arch):
    """bf16 (AMX tiles, AVX512-BF16's dot products, or AVX2's in fp32): a sparse MLP (router, routing,
    experts) in the C loop gives the Python forward's tokens, logprobs and each step's routed experts;
    qwen2_moe's shared expert keeps Python's forward."""
    from engine.models import moe_model

    llm = LLM(EngineConfig(model=moe_dirs[arch], dtype="bfloat16", max_num_seqs=8, max_model_len=256))
    blocks = moe_model.sparse_blocks(llm.core.worker.model)
    seen = []
    real = moe_model.SparseMoeBlock.forward
    monkeypatch.setattr(moe_model.SparseMoeBlock, "forward", lambda self, y: seen.append(1) or real(self, y))
    _run(llm, monkeypatch, "0")
    seen.clear()
    python = _run(llm, monkeypatch, "0")
    python_ids, in_python = [b.last_ids.clone() for b in blocks], len(seen)
    calls["native"] = 0
    seen.clear()
    native = _run(llm, monkeypatch, "1")
    if arch == "qwen2_moe":
        assert calls["native"] == 0
    else:
        assert calls["native"] > 0 and len(seen) < in_python / 3  # decode steps' blocks in C: prefills' in Python
    assert native == python
    assert all(torch.equal(b.last_ids, ids) for b, ids in zip(blocks, python_ids))  # the last step's, alike


@bf16_loop
def test_a_hook_on_a_layer_keeps_the_python_forward(model_dirs, monkeypatch, calls):
    llm = LLM(EngineConfig(model=model_dirs["llama"], dtype="bfloat16", max_num_seqs=8, max_model_len=256))
    model = llm.core.worker.model
    before = _run(llm, monkeypatch, "1")
    assert calls["native"] > 0
    calls["native"] = 0
    seen = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        assert _run(llm, monkeypatch, "1") == before
    finally:
        handle.remove()
    assert calls["native"] == 0 and len(seen) > 0  # every decode step ran the hooked module in Python


@bf16_loop
def test_a_push_is_served_from_the_first_step_after_it(model_dirs, monkeypatch, calls):
    """The C loop reads the weights' current copies each step: a weight written between two
    generates (as a commit writes it) changes the next step's output, as in Python."""
    llm = LLM(EngineConfig(model=model_dirs["llama"], dtype="bfloat16", max_num_seqs=8, max_model_len=256))
    model = llm.core.worker.model
    before = _run(llm, monkeypatch, "1")
    with torch.no_grad():
        w = model.model.layers[0].self_attn.o_proj.weight
        w.copy_(w * 1.5)
    python = _run(llm, monkeypatch, "0")
    native = _run(llm, monkeypatch, "1")
    assert native == python != before


@f32_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3", "qwen3", "qwen3_yarn", "mistral_window", "qwen2_window",
                                  "gemma3", "phi3"])
def test_the_fp32_c_loop_keeps_hfs_greedy_tokens_and_logprobs(dirs, hf_models, variant_hf_models, monkeypatch, calls,
                                                              arch):
    monkeypatch.setenv(native_layers.ENV_SWITCH, "1")
    llm = LLM(EngineConfig(model=dirs[arch], max_num_seqs=8, max_model_len=256))
    prompts = random_prompts(6, 3, 40, 400, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    assert calls["native"] > 0
    hf = {**hf_models, **variant_hf_models}.get(arch)
    if hf is None:  # gemma3, phi3
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(dirs[arch], dtype=torch.float32).eval()
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        assert c.token_ids == hf_greedy(hf, p, 16, ignore_eos=True)
        tol = fp32_logprob_tolerance(hf.config, activation_magnitude(hf, p + c.token_ids))
        assert [_plain(d) for d in c.logprobs] == pytest.approx(hf_logprobs(hf, p, c.token_ids), abs=tol)


@f32_kernel
def test_the_fp32_engine_on_its_weights_in_place_gives_the_packed_copys_tokens_and_logprobs(model_dirs, monkeypatch,
                                                                                            calls):
    """ROLLOUT_F32_IN_PLACE=1 (no panels held): the same bits as the packed copy, in the C loop too."""
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(f32_linears.IN_PLACE_SWITCH, switch)
        llm = LLM(EngineConfig(model=model_dirs["qwen2"], dtype="float32", max_num_seqs=8, max_model_len=256))
        outs[switch] = _run(llm, monkeypatch, "1")
    assert outs["1"] == outs["0"] and calls["native"] > 0


@pytest.mark.skipif(BF16_KERNELS or not f32_linears.available()
                    or packed_linears.compute_dtype(torch.bfloat16) != torch.float32,
                    reason="a CPU with bf16 kernels reads a bf16 model's weights in place anyway; or no fp32 kernel")
def test_a_bf16_model_on_its_weights_in_place_gives_the_bf16_panels_tokens_and_logprobs(model_dirs, monkeypatch,
                                                                                        calls):
    """On a CPU without bf16 kernels (AVX2), ROLLOUT_F32_IN_PLACE=1 serves a bf16 model's linears from its bf16
    weights (f32_linear_rows_bf16: no panels held, none derived by a push): the bf16 panels' bits, in the C loop
    and in the prefill, before a push and after it."""
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(f32_linears.IN_PLACE_SWITCH, switch)
        llm = LLM(EngineConfig(model=model_dirs["qwen2"], dtype="bfloat16", max_num_seqs=8, max_model_len=256))
        worker = llm.core.worker
        before = _run(llm, monkeypatch, "1")
        held = worker.memory()["derived_copies"]
        pairs = [(p, (p.detach() * 1.05).to(p.dtype)) for p in worker.model.parameters()]
        staged = worker.stage_derived_copies(pairs)
        with torch.no_grad():
            for p, t in pairs:
                p.copy_(t)
        worker.weights_written(staged)
        outs[switch] = (before, _run(llm, monkeypatch, "1"), held, staged.derived)
    assert outs["1"][:2] == outs["0"][:2] and outs["1"][0] != outs["1"][1] and calls["native"] > 0
    assert outs["1"][2:] == (0, 0) and outs["0"][2] > 0 and outs["0"][3] > 0
