"""int8 linears (engine/kernels/int8_linears.py): the product within the error int8 rounding allows, the copy
derived again whenever the full-precision weight (the truth) changes, and an int8 engine's
logprobs those of the int8 policy, not of the fp32 one."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import amx_linears, derived_weights, int8_linears
from engine.models.model_loader import quantized_bytes

pytestmark = pytest.mark.skipif(int8_linears.kernel() is None, reason="no exact int8 kernel on this CPU")

U32 = 2.0**-24


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|int8 - exact| per output, [M, N], for the kernel this CPU runs.

    Per token (W8A8): x ~ sx (qx + ex), w ~ sw (qw + ew) with |e| <= 1/2, sx = max|x_m| / 127,
    sw = max|w_n| / qmax; each product's error is sx sw |qx ew + ex qw + ex ew| <= sx sw (127/2 +
    qmax/2 + 1/4); the int32 sum of K of them is exact, and the two fp32 scalings and the fp32
    reference add a few roundings of the largest possible sum K max|x_m| max|w_n|.

    Weight-only (W8A16, groups of amx_linears.W8_GROUP): x is rounded to bf16 (2^-9 of |x|); w to q s with s <=
    max|w_n| (1 + 2^-8) / 127 (a bf16 scale) and |w - q s| <= s / 2 + 127 s 2^-8 (the clamp where
    the scale rounded down), then q s to bf16 (2^-9); the K products sum in fp32."""
    name, qmax = int8_linears.kernel()
    k = x.shape[-1]
    ax, aw = x.abs().amax(-1, keepdim=True), w.abs().amax(-1)
    if name in int8_linears.WEIGHT_ONLY:
        s = (1 + 2.0**-8) / 127
        per_product = (s * (0.5 + 127 * 2.0**-8) + 2.0**-9) * (1 + 2.0**-9) + 2.0**-9 + 4 * k * U32
    else:
        per_product = (0.5 / qmax + 0.5 / 127 + 0.25 / (127 * qmax)) + 4 * k * U32
    return k * ax * aw * per_product


def _layer(out_features=48, in_features=64, bias=True, dtype=torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype).requires_grad_(False)
    assert int8_linears.install(torch.nn.Sequential(layer)) == 1
    return layer


def _close(layer: torch.nn.Linear, x: torch.Tensor) -> None:
    want = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    got = layer(x).double()
    assert ((got - want).abs() <= _bound(x.reshape(-1, x.shape[-1]), layer.weight).reshape(got.shape)).all()


def test_the_int8_product_is_within_what_int8_rounding_allows_at_every_row_count():
    layer = _layer(out_features=96, in_features=128)
    for rows in (1, 5, 33, 300, 1100):  # one row, bucket padding, blocks of 1024
        x = torch.randn(rows, 128)
        x[:, 7] *= 30  # an outlier channel, as decoders have
        _close(layer, x)


def test_a_row_is_computed_from_itself_alone():
    """Per-token scales: another row's outlier, or the padding a bucket adds, moves no row."""
    layer, x = _layer(), torch.randn(3, 64)
    alone = layer(x[:1])
    crowd = torch.cat([x[:1], 100 * x[1:]])
    assert torch.equal(layer(crowd)[:1], alone)


def test_the_copy_follows_a_swap_a_copy_and_the_drop_of_a_commit():
    layer, x = _layer(), torch.randn(4, 64)
    _close(layer, x)
    first = layer._derived
    layer.weight.data = torch.randn(48, 64)  # a swap commit: the storage moves
    _close(layer, x)
    assert layer._derived is not first
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64))  # a copy commit: the version counter moves
    _close(layer, x)
    a, b = layer.weight.data, torch.randn(48, 64)
    layer.weight.data = b
    a.copy_(torch.randn(48, 64))  # the staging buffer written through its own view
    layer.weight.data = a
    derived_weights.drop(layer)  # what a commit with no staged copies does (Worker.weights_written)
    _close(layer, x)


def test_derive_is_pure_and_the_weight_stays_the_truth():
    w = torch.randn(32, 64)
    before = w.clone()
    copy = int8_linears.derive(w)
    # a 2-byte scale a row's W8_GROUP values (weight-only), else a 4-byte one a row
    scales = 2 * 32 * (64 // amx_linears.W8_GROUP) if copy.kernel in int8_linears.WEIGHT_ONLY else 4 * 32
    assert torch.equal(w, before) and copy.nbytes == 32 * 64 + scales
    layer = _layer(out_features=32)
    layer(torch.randn(2, 64))
    assert layer.weight.dtype == torch.float32 and layer.state_dict()["weight"].dtype == torch.float32


def test_a_bf16_layer_adds_one_bf16_rounding():
    layer = _layer(dtype=torch.bfloat16)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    got = layer(x).double()
    # the output rounded to bf16 twice (the kernel's, then after the token scale): 2^-8 relative each
    slack = 2 * 2.0**-8 * want.abs() + 2 * 2.0**-8 * _bound(x.float(), layer.weight.float())
    assert ((got - want).abs() <= _bound(x.float(), layer.weight.float()) + slack).all()


def test_training_mode_runs_the_full_precision_weight():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    int8_linears.install(torch.nn.Sequential(layer))
    x = torch.randn(2, 64)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_an_int8_engine_samples_from_the_int8_policy(qwen2_dir):
    """Its logprobs are the int8 model's: not the fp32 engine's on the same tokens, and close to
    them (the lm_head is kept full precision, every other linear is int8)."""
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fp32 = LLM(EngineConfig(model=qwen2_dir, max_model_len=128))
    int8 = LLM(EngineConfig(model=qwen2_dir, max_model_len=128, quantization="int8"))
    assert quantized_bytes(int8.core.runner.model) > 0
    a = int8.generate(prompts, params, use_tqdm=False)
    lp_int8 = [x for o in a for x in o.outputs[0].logprobs]
    # the fp32 engine's logprobs of the int8 engine's tokens, as a trainer's forward would score them
    check = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    rescored = fp32.generate([p + o.outputs[0].token_ids for p, o in zip(prompts, a)], check, use_tqdm=False)
    lp_fp32 = [r.prompt_logprobs[len(p) + j][t].logprob
               for r, p, o in zip(rescored, prompts, a) for j, t in enumerate(o.outputs[0].token_ids)]
    diff = (torch.tensor(lp_int8) - torch.tensor(lp_fp32)).abs()
    assert diff.max() > 1e-4  # another policy than fp32's (whose own rescoring agrees to ~1e-6)
    assert diff.max() < 0.5  # but close: int8 rounding, not another model


def test_bad_quantizations_are_refused_by_name(qwen2_dir):
    with pytest.raises(ValueError, match="int8.*CPU only"):
        EngineConfig(model=qwen2_dir, device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="fp8.*CUDA only"):
        EngineConfig(model=qwen2_dir, quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=qwen2_dir, quantization="int4")
    assert EngineConfig(model=qwen2_dir, quantization="auto").quantization == "int8"
    assert EngineConfig(model=qwen2_dir, device="cuda", quantization="auto").quantization == "fp8"


def test_the_copy_bytes_are_one_byte_a_weight_and_its_scales():
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 16))
    model[0].requires_grad_(False)
    assert int8_linears.install(model) == 2
    if int8_linears.kernel()[0] in int8_linears.WEIGHT_ONLY:  # a 2-byte scale a row's W8_GROUP values of K
        group = amx_linears.W8_GROUP
        scales = 2 * 48 * -(-64 // group) + 2 * 16 * -(-48 // group)
    else:  # a 4-byte scale a row
        scales = 4 * 48 + 4 * 16
    assert quantized_bytes(model) == 48 * 64 + 16 * 48 + scales
    x = torch.randn(3, 64)
    with torch.no_grad():
        model(x)  # derives both copies: their own count agrees
    assert sum(m._derived.nbytes for m in model) == quantized_bytes(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_row_quantizer_gives_torchs_bits(dtype, monkeypatch):
    """engine/kernels/native/quantize_rows.c against the torch ops it replaces: the same scales and codes,
    ties (x / scale exactly k + 0.5) rounded to even, an all-zero row, rows of several widths."""
    from engine.kernels import native_quantize

    if native_quantize.quantize_rows(torch.ones(1, 4, dtype=dtype)) is None:
        pytest.skip("no C compiler here: the torch ops run")
    g = torch.Generator().manual_seed(5)
    for rows, cols in [(1, 64), (32, 576), (7, 1536), (300, 960)]:
        x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
        x[0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127, -127, 63.5]).to(dtype)  # scale 1: ties
        if rows > 1:
            x[1] = 0
        native = native_quantize.quantize_rows(x)
        monkeypatch.setattr(native_quantize, "quantize_rows", lambda _: None)
        ref = int8_linears.quantize_rows(x)
        monkeypatch.undo()
        assert torch.equal(native[0], ref[0]) and torch.equal(native[1], ref[1])
        assert native[0][0, :5].tolist() == [0, 2, 2, 0, -2]  # half to even


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_row_scaling_gives_torchs_bits(dtype):
    from engine.kernels import native_quantize

    g = torch.Generator().manual_seed(6)
    out = (torch.randn(33, 960, generator=g) * 50).to(dtype)
    scale = torch.rand(33, 1, generator=g) / 127
    ref = out.clone().mul_(scale)
    if not native_quantize.scale_rows_(out, scale):
        pytest.skip("no C compiler here: torch's mul_ runs")
    assert torch.equal(out, ref)
