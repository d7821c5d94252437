"""Prepacked linears (engine/kernels/packed_linears.py): the packed copy follows every way a push changes a
weight, frees with the weights, and the engine on it still gives HF's greedy tokens."""

import math

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import amx_linears, bf16_rows, f32_linears, packed_linears
from tests.engine.helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not packed_linears.supported(torch.float32),
                                reason="this torch build has no oneDNN fp32 linear")

U32 = 2.0**-24


def _bound(x: torch.Tensor, w: torch.Tensor) -> float:
    """Two fp32 sums of K products, each off by at most K·u·Σ|products| <= K·u·K·max|x|·max|w|
    in any order of summation, differ by twice that: a wrong weight misses it by orders."""
    k = x.shape[-1]
    return 2 * k * U32 * k * x.abs().max().item() * w.abs().max().item()


def _layer(out_features=48, in_features=64, bias=True) -> torch.nn.Linear:
    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    assert packed_linears.pack(torch.nn.Sequential(layer), torch.float32) == 1
    return layer


def _close(layer: torch.nn.Linear, x: torch.Tensor) -> None:
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert (layer(x) - want).abs().max().item() <= _bound(x, layer.weight) + 1e-6


def test_the_packed_weight_follows_a_swap_and_a_copy():
    layer, x = _layer(), torch.randn(1, 5, 64)
    _close(layer, x)
    packed = layer._derived
    layer.weight.data = torch.randn(48, 64)  # a swap commit: the storage moves
    _close(layer, x)
    assert layer._derived is not packed
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64))  # a copy commit: the version counter moves
    _close(layer, x)
    with torch.no_grad():
        layer.weight[3].mul_(-2.0)  # a write through a view moves the same counter
    _close(layer, x)


def test_a_weight_swapped_back_onto_a_rewritten_buffer_needs_the_drop_a_commit_makes():
    """The CPU staging pool's two buffers: a commit points a weight back at the one it held two pushes
    ago, written meanwhile through a view of its own. Pointer and version look unchanged: only the
    commit's `drop` (Worker.weights_written) tells a packed copy."""
    layer, x = _layer(), torch.randn(4, 64)
    a, b = torch.randn(48, 64), torch.randn(48, 64)
    layer.weight.data = a
    _close(layer, x)
    layer.weight.data = b
    a.copy_(torch.randn(48, 64))  # the next push lands in the free buffer, through its own view
    layer.weight.data = a
    stale = layer(x)
    packed_linears.drop(layer)
    _close(layer, x)
    assert not torch.equal(stale, layer(x))  # what the drop is for


@pytest.mark.skipif(not f32_linears.available(), reason="no AVX-512: fp32 runs on oneDNN's packed copy")
def test_an_fp32_layer_on_its_weights_in_place_reads_a_rewritten_buffer_as_it_is(monkeypatch):
    """With no copy (f32_linears.linear_rows, ROLLOUT_F32_IN_PLACE=1), the same buffer rewritten is
    read as it is now: no drop needed, and the packed kernel's bits."""
    monkeypatch.setenv(f32_linears.IN_PLACE_SWITCH, "1")
    layer, x = _layer(), torch.randn(4, 64)
    a, b = torch.randn(48, 64), torch.randn(48, 64)
    layer.weight.data = a
    _close(layer, x)
    assert isinstance(layer._derived, packed_linears.derived_weights.WeightRows) and layer._derived.nbytes == 0
    layer.weight.data = b
    a.copy_(torch.randn(48, 64))
    layer.weight.data = a
    assert torch.equal(layer(x), f32_linears.linear(x, f32_linears.pack(a), layer.bias))


def test_a_bf16_layer_keeps_a_bf16_gemms_arithmetic():
    """bf16 runs on bf16 kernels, or (on a CPU without them) on the fp32 kernel with the output rounded
    once: either way within one bf16 rounding of the output (2^-8 relative, twice: both sides
    round) plus the fp32 sums' reordering of bf16 F.linear."""
    torch.manual_seed(1)
    layer = torch.nn.Linear(64, 48, dtype=torch.bfloat16).requires_grad_(False)
    wide = packed_linears.compute_dtype(torch.bfloat16)
    assert wide in (torch.bfloat16, torch.float32)
    packed_linears.pack(torch.nn.Sequential(layer), wide)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias).float()
    got = layer(x)
    assert got.dtype == torch.bfloat16
    bound = 2 * 2.0**-8 * ref.abs() + _bound(x.float(), layer.weight.float())
    assert ((got.float() - ref).abs() <= bound).all()


def test_repack_packs_at_once_and_drop_frees():
    layer = _layer(bias=False)
    assert layer._derived is None
    packed_linears.repack(layer)
    assert layer._derived is not None
    packed_linears.drop(layer)
    assert layer._derived is None and layer._derived_key is None
    _close(layer, torch.randn(7, 64))  # a forward after a drop packs again


def test_a_forward_with_grad_takes_the_plain_path():
    layer = _layer().requires_grad_(True)
    x = torch.randn(3, 64)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer._derived is None


def test_the_engine_packs_its_linears_and_keeps_hfs_greedy_tokens(model_dirs, hf_models):
    llm = LLM(EngineConfig(model=model_dirs["qwen2"], max_num_seqs=16, max_model_len=256, prepack_linears=True))
    model = llm.core.worker.model
    packed = [m for m in model.modules() if getattr(m, "_derived_key", False) is not False]
    assert len(packed) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) > 0
    prompts = random_prompts(6, 3, 40, 2000, seed=7)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    # each linear serves from a packed copy: its own, or its group's (q/k/v and gate/up: fused_linears)
    assert all(m._derived is not None or (getattr(m, "_group", None) and m._group.copy is not None) for m in packed)
    assert sum(getattr(m, "_group", None) is not None for m in packed) == 5 * model.config.num_hidden_layers
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_models["qwen2"], p, 16)
    assert math.isfinite(llm.core.worker.runner.forward_seconds)


@pytest.mark.skipif(not (amx_linears.available() or bf16_rows.avx512_bf16()),
                    reason="no AMX tiles or AVX512-BF16 here: bf16 keeps a packed copy")
def test_a_bf16_engine_on_amx_or_avx512_bf16_holds_no_copy_of_its_linears(model_dirs):
    """Every linear, and each q/k/v and gate/up group, serves from the parameters' own memory: the
    engine holds its weights once, and a push has nothing to derive for them."""
    llm = LLM(EngineConfig(model=model_dirs["llama"], dtype="bfloat16", max_num_seqs=8, max_model_len=256))
    model = llm.core.worker.model
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = {p.data_ptr() for p in model.parameters()}
    copies = [m._group.copy if getattr(m, "_group", None) else m._derived
              for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert copies and all(isinstance(c, amx_linears.AmxRows) and c.nbytes == 0 for c in copies)
    assert all(w.data_ptr() in params for c in copies for w in c.weights)


@pytest.mark.skipif(not bf16_rows.avx512_bf16() or amx_linears.available(),
                    reason="the choice of an AVX512-BF16 CPU without AMX tiles")
def test_a_bf16_engine_on_avx512_bf16_reads_in_place_with_few_sequences_unless_switched_off(model_dirs,
                                                                                            monkeypatch):
    """Switched off, or past AVX512_MAX_SEQS sequences (oneDNN's packed op 1.04-1.06x the in-place kernel at
    128-256 rows), an engine packs; one of fewer reads its weights in place by default. Either way every row of
    it sums in one order."""
    def copies(max_seqs):
        llm = LLM(EngineConfig(model=model_dirs["llama"], dtype="bfloat16", max_num_seqs=max_seqs, max_model_len=256))
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        return [m._group.copy if getattr(m, "_group", None) else m._derived
                for m in llm.core.worker.model.modules() if isinstance(m, torch.nn.Linear)]
    monkeypatch.setenv(bf16_rows.ENV_SWITCH, "0")
    assert not any(isinstance(c, amx_linears.AmxRows) for c in copies(8))
    monkeypatch.delenv(bf16_rows.ENV_SWITCH)
    few, many = copies(bf16_rows.AVX512_MAX_SEQS), copies(bf16_rows.AVX512_MAX_SEQS + 1)
    assert few and all(isinstance(c, amx_linears.AmxRows) for c in few)
    assert many and not any(isinstance(c, amx_linears.AmxRows) for c in many)


def test_any_row_count_runs_at_a_bucketed_one_and_keeps_each_rows_sum(monkeypatch):
    """oneDNN caches a primitive per row count: every batch, however many rows, reaches it at the
    ROW_BUCKETS counts only, and the rows padded in (whatever the kept buffer held) change no real
    row's result."""
    monkeypatch.setattr(f32_linears, "available", lambda: False)  # fp32 on oneDNN, as on a CPU without AVX-512
    seen = []
    real = packed_linears._onednn_linear
    monkeypatch.setattr(packed_linears, "_onednn_linear", lambda x, w, b: seen.append(x.shape[0]) or real(x, w, b))
    layer = _layer()
    for rows in [*range(1, 70), 129, 383, 511, 512, 513, 1024, 1100, 2100]:
        x = torch.randn(rows, 64)
        _close(layer, x)
        if rows <= 512:  # a row's sum does not depend on the rows beside it
            one = layer(x[-1:])
            assert (layer(x)[-1:] - one).abs().max().item() <= _bound(x, layer.weight) + 1e-6
    assert set(seen) <= set(packed_linears.ROW_BUCKETS) and max(seen) == packed_linears.BLOCK_ROWS
    assert _close(layer, torch.randn(2, 3, 7, 64)) is None  # leading dims are rows too
    assert packed_linears.bucket(2100 - 2048) == 56 and packed_linears.bucket(33) == 36


def test_prepack_off_keeps_torchs_linear(model_dirs):
    llm = LLM(EngineConfig(model=model_dirs["qwen2"], max_model_len=128, prepack_linears=False))
    assert not any(hasattr(m, "_derived_key") for m in llm.core.worker.model.modules())


def test_a_layer_runs_outside_inference_mode_after_a_forward_inside_it():
    """The kept padding buffer is shared by every forward of a thread: one first made under
    inference mode (an engine's step) must still take rows outside it (a script's own call)."""
    layer = _layer(out_features=32, in_features=96)  # a width no other test pads to: a fresh buffer here
    x = torch.randn(1, 5, 96)  # 5 rows run at a bucketed count: padded
    with torch.inference_mode():
        _close(layer, x)
    _close(layer, x)
