"""weight_sync.common.lora's pure parts: the merge is PEFT's bit for bit, the listing names what the
engine knows, and a bad adapter manifest is refused with the module named."""

import copy

import pytest
import torch

from weight_sync import weights_checksum
from weight_sync.common.lora import adapter_problems
from weight_sync.common.manifest import AdapterSpec, build_manifest, dtype_name, model_params, param_infos
from weight_sync.trainer.lora_push import (
    AdapterPush, adapter_weights, base_id, base_weights, merged_weights, push_source,
)

peft = pytest.importorskip("peft")

TARGET_SETS = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]]


def lora_model(base, targets, r=4, alpha=8, seed=0, **kw):
    """A PEFT LoRA model over a copy of `base` whose factors are random (PEFT starts B at zero,
    which would make every adapter a no-op)."""
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                                     **kw))
    randomize(model, seed)
    return model


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def hf_merged(model):
    """The reference: PEFT's own merge_and_unload, on a copy."""
    return copy.deepcopy(model).merge_and_unload()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("targets", TARGET_SETS)
@pytest.mark.parametrize("rslora", [False, True])
def test_merged_weights_are_merge_and_unload_bit_for_bit(hf_models, arch, targets, rslora):
    model = lora_model(hf_models[arch], targets, use_rslora=rslora)
    ours = merged_weights(model)
    ref = hf_merged(model)
    assert weights_checksum(ours) == weights_checksum(ref.named_parameters())
    assert [n for n, _ in ours] == [n for n, _ in ref.named_parameters()]


def test_the_listing_names_modules_as_the_engine_does(hf_models):
    model = lora_model(hf_models["qwen2"], ["q_proj", "down_proj"], r=3, alpha=6)
    named, scales = adapter_weights(model)
    engine_params, _ = model_params(hf_models["qwen2"])
    assert {n.rsplit(".", 1)[0] + ".weight" for n, _ in named} <= set(engine_params)
    assert set(scales.values()) == {2.0}
    a = dict(named)["model.layers.0.self_attn.q_proj.lora_A"]
    assert a.shape[0] == 3
    assert [n for n, _ in base_weights(model)] == list(engine_params)


def test_base_id_follows_the_base_not_the_adapter(hf_models):
    model = lora_model(hf_models["qwen2"], ["q_proj"])
    first = base_id(model)
    randomize(model, 5)  # training moves the adapter only
    assert base_id(model) == first == weights_checksum(hf_models["qwen2"].named_parameters())
    with torch.no_grad():
        model.get_base_model().model.norm.weight.add_(1.0)  # a different base
    assert base_id(model) != first


def _manifest(named, scales, base="b", with_base=False, model=None):
    specs = [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in named]
    m = build_manifest(specs, 1, 1 << 20)
    import msgspec

    return msgspec.structs.replace(m, adapter=AdapterSpec(base_id=base, scales=scales, with_base=with_base))


def _problems(hf_model, named, scales, with_base=False):
    params, aliases = model_params(hf_model)
    return adapter_problems(_manifest(named, scales, with_base=with_base), param_infos(params), aliases)


def test_a_good_adapter_manifest_has_no_problem(hf_models):
    model = lora_model(hf_models["qwen2"], ["q_proj", "down_proj"])
    named, scales = AdapterPush(model).listing()[0], adapter_weights(model)[1]
    assert _problems(hf_models["qwen2"], named, scales) == []
    named_b, spec = AdapterPush(model, with_base=True).listing()
    assert spec.with_base and _problems(hf_models["qwen2"], named_b, scales, with_base=True) == []


def test_bad_adapter_manifests_name_the_problem(hf_models):
    base = hf_models["qwen2"]
    model = lora_model(base, ["q_proj"])
    named, scales = adapter_weights(model)
    q = "model.layers.0.self_attn.q_proj"
    wrong_rank = [(n, t[:, :2] if n == q + ".lora_B" else t) for n, t in named]  # B of rank 2 for an A of rank 4
    assert any(q in p and "rank-r" in p for p in _problems(base, wrong_rank, scales))
    absent = [(n.replace("q_proj", "x_proj"), t) for n, t in named]
    assert any("no linear layer" in p for p in _problems(base, absent, {k.replace("q_proj", "x_proj"): v
                                                                          for k, v in scales.items()}))
    lonely = [(n, t) for n, t in named if n != q + ".lora_B"]
    assert any("needs both" in p for p in _problems(base, lonely, scales))
    assert any("not finite" in p for p in _problems(base, named, {**scales, q: float("nan")}))
    assert any("without its base" in p for p in _problems(base, named + [("model.norm.weight", base.model.norm.weight)],
                                                             scales))
    assert any("missing names" in p for p in _problems(base, named, scales, with_base=True))
    tied = [("lm_head.lora_A", torch.zeros(2, 64)), ("lm_head.lora_B", torch.zeros(base.lm_head.weight.shape[0], 2))]
    if base.config.tie_word_embeddings:
        assert any("tied" in p for p in _problems(base, tied, {"lm_head": 1.0}))


def test_what_an_adapter_push_cannot_carry_is_refused_up_front(hf_models):
    base = hf_models["qwen2"]
    with pytest.raises(ValueError, match="DoRA"):
        push_source(lora_model(base, ["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="bias"):
        push_source(lora_model(base, ["q_proj"], bias="lora_only"))
    with pytest.raises(ValueError, match="mode must be"):
        push_source(lora_model(base, ["q_proj"]), "half")
    assert isinstance(push_source(lora_model(base, ["q_proj"]), "merged"), list)
    assert push_source(base) is base
