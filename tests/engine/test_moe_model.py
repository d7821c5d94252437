"""engine/models/moe_model.py: the engine's own mixture-of-experts layers hold HF's parameters under
transformers 5's names, load per-expert checkpoints into them, compute HF's sparse block bit for bit
(fp32 and bf16: the same operations in the same order), and give HF's greedy tokens in fp32."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import moe_experts
from engine.models import moe_model
from engine.models.tiny_model import MOE_ARCHS
from tests.engine.helpers import hf_greedy, random_prompts


def _hf(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_parameters_are_hfs_under_hfs_names(arch, moe_dirs):
    ours, theirs = moe_model.load(moe_dirs[arch], torch.float32), _hf(moe_dirs[arch])
    mine, hf = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert list(mine) == list(hf)
    for name, p in hf.items():
        assert torch.equal(mine[name], p), name
    assert mine["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_sparse_block_is_hfs_bit_for_bit(arch, dtype, moe_dirs, monkeypatch):
    """The torch path (the reference the C block is held to: test_moe_experts.py): routing, each
    expert's GEMMs, the weighting and the sum in HF's order, equal bits, on a batch where some
    experts get no token and one token's rows sit beside many others'. In fp32 within the bound of
    a reordered sum: on an AVX2 host one expert's GEMM came out 2e-6 off HF's (the same routing)."""
    monkeypatch.setattr(moe_experts, "block_native", lambda *a: None)
    monkeypatch.setattr(moe_experts, "router_logits", lambda *a: None)  # F.linear, HF's router
    ours, theirs = moe_model.load(moe_dirs[arch], dtype), _hf(moe_dirs[arch], dtype)
    g = torch.Generator().manual_seed(1)
    for layer in (0, len(ours.model.layers) - 1):
        mine, hf = ours.model.layers[layer].mlp, theirs.model.layers[layer].mlp
        for tokens in (1, 3, 37):
            y = torch.randn(1, tokens, ours.config.hidden_size, generator=g).to(dtype)
            with torch.inference_mode():
                got, want = mine(y), hf(y)
            if dtype == torch.bfloat16:
                assert torch.equal(got, want), (layer, tokens)
            else:  # one fp32 GEMM may block its sums otherwise than HF's on some CPUs (AVX2 hosts)
                assert ((got - want).abs() <= _reorder_bound(mine, y, ours.config)).all(), (layer, tokens)
            assert mine.last_ids.shape == (tokens, ours.config.num_experts_per_tok)


def _reorder_bound(mlp, y: torch.Tensor, config) -> torch.Tensor:
    """How far two fp32 evaluations of a sparse block that differ only in the order of their sums may
    lie apart, element by element, on the routing both took (`mlp.last_ids`): twice one evaluation's
    error bound, from the magnitudes of its terms (taken in float64): each pick's gate and up are
    dot products of length H (error gamma_H * |W| @ |x|), carried through silu (|silu'| <= 1.1) and
    the product into h; down is a dot product of length I over h, then k weighted picks (weights <= 1)
    summed: gamma_(I+k) * |W_down| @ |h| + |W_down| @ |dh|. The shared expert (qwen2_moe) adds its own."""
    assert config.hidden_act == "silu"
    x, u = y.reshape(-1, y.shape[-1]).double(), 2.0 ** -24
    k, e = config.num_experts_per_tok, mlp.experts

    def gamma(n: int) -> float:
        return n * u / (1 - n * u)

    def chain(gate_up: torch.Tensor, down: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        g, up = (gate_up @ row).chunk(2)
        ag, au = (gate_up.abs() @ row.abs()).chunk(2)
        h = torch.nn.functional.silu(g) * up
        dh = gamma(row.numel()) * (1.1 * ag * up.abs() + torch.nn.functional.silu(g).abs() * au)
        return gamma(down.shape[-1] + k) * (down.abs() @ h.abs()) + down.abs() @ dh

    bound = torch.zeros(x.shape[0], e.down_proj.shape[1], dtype=torch.float64)
    for t, row in enumerate(x):
        for ex in mlp.last_ids[t].tolist():
            bound[t] += chain(e.gate_up_proj[ex].double(), e.down_proj[ex].double(), row)
        if (shared := getattr(mlp, "shared_expert", None)) is not None:  # gated by a sigmoid (<= 1)
            w = torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).double()
            bound[t] += chain(w, shared.down_proj.weight.double(), row)
    return 2 * bound.view(y.shape).float()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_matches_hf(arch, moe_dirs):
    llm = LLM(EngineConfig(model=moe_dirs[arch], max_model_len=256))
    assert isinstance(llm.core.worker.model.model.layers[0].mlp, moe_model.SparseMoeBlock)
    hf = _hf(moe_dirs[arch])
    prompts = random_prompts(6, 4, 40, 2000, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16, ignore_eos=True)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_greedy_matches_hf_with_the_experts_on_panels_or_in_place(moe_dirs, monkeypatch, switch):
    """Either way the experts run here (ROLLOUT_EXPERT_PANELS: over a copy as panels, AVX2's default;
    on the weights in place, AVX-512's), both through the C decode loop: HF's greedy tokens in fp32."""
    from engine.kernels import f32_linears

    if not f32_linears.available():
        pytest.skip("no AVX-512 or AVX2, or no C compiler")
    from engine.models import native_layers

    monkeypatch.setenv(moe_experts.PANELS_SWITCH, switch)
    llm = LLM(EngineConfig(model=moe_dirs["qwen3_moe"], max_model_len=256))
    experts = llm.core.worker.model.model.layers[0].mlp.experts
    assert (moe_experts.served_panels(experts) is not None) == (switch == "1")
    steps, real = [], native_layers.decode

    def counted(*args):
        out = real(*args)
        steps.append(out is not None)
        return out

    monkeypatch.setattr(native_layers, "decode", counted)
    hf = _hf(moe_dirs["qwen3_moe"])
    prompts = random_prompts(6, 4, 40, 2000, seed=7)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert any(steps)  # decode steps ran in the C loop (its rows built by native_layers)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16, ignore_eos=True)


def test_a_core_loads_an_moe_without_transformers(moe_dirs):
    import subprocess
    import sys

    code = ("import sys, torch\nfrom engine.config import EngineConfig\n"
            "from engine.models.model_loader import load_model\n"
            f"m = load_model(EngineConfig(model={moe_dirs['qwen3_moe']!r}), torch.device('cpu'))\n"
            "print(type(m.model.layers[0].mlp).__module__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["engine.models.moe_model", "False"]
