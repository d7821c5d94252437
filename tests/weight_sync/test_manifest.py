"""Pure functions: bucket planning, manifest layout checks, validation against a model, dtype
policy, the shared checksum, name cleaning and wrapper unwrapping. No processes, no network."""

import math

import msgspec
import pytest
import torch

from weight_sync.common.checksum import dedup_tied, weights_checksum
from weight_sync.common.manifest import (
    ALIGNMENT, Bucket, Manifest, ParamInfo, build_manifest, can_take, check_layout, model_params, param_infos,
    plan_layout, validate_manifest,
)
from weight_sync.trainer.sender import WeightSender
from weight_sync.trainer.weights import clean_name, named_weights, unwrap_model


# -- bucket planning -------------------------------------------------------------------------
def _check_plan(sizes, bucket, align=16):
    offsets, layout, buckets = plan_layout(sizes, bucket, align)
    assert all(o % align == 0 for o in offsets)
    ends = [o + n for o, n in zip(offsets, sizes)]
    assert all(e <= o2 for e, o2 in zip(ends, offsets[1:]))  # in order, no overlap
    assert layout == (ends[-1] if sizes else 0)
    # buckets tile the tensors in order, each within the bucket size unless one tensor is bigger
    covered = 0
    for b in buckets:
        assert b.first == covered and b.last > b.first
        covered = b.last
        assert b.start == offsets[b.first] and b.end == ends[b.last - 1]
        live = [i for i in range(b.first, b.last) if sizes[i]]
        assert b.nbytes <= bucket or len(live) == 1
    assert covered == len(sizes)
    return offsets, layout, buckets


def test_plan_groups_small_tensors_and_isolates_big_ones():
    offsets, layout, buckets = _check_plan([10, 20, 0, 300, 5, 5], 64)
    assert offsets == [0, 16, 48, 48, 352, 368]
    assert [(b.first, b.last) for b in buckets] == [(0, 3), (3, 4), (4, 6)]
    assert buckets[1].nbytes == 300  # bigger than a bucket: alone


@pytest.mark.parametrize("seed", range(5))
def test_plan_random_sizes(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [int(x) for x in torch.randint(0, 5000, (200,), generator=g)]
    sizes[::17] = [0] * len(sizes[::17])
    _check_plan(sizes, 4096, 256)


def test_plan_edge_cases():
    assert plan_layout([], 64) == ([], 0, [])
    _, _, buckets = _check_plan([0, 0, 100], 64)
    assert [(b.start, b.end) for b in buckets] == [(0, 100)]  # empties ride along, never alone
    _, _, buckets = _check_plan([8] * 10, 1)  # tiny bucket size: one tensor per bucket
    assert len(buckets) == 10
    _, _, buckets = _check_plan([8] * 10, 10**9)  # huge bucket size: one bucket
    assert len(buckets) == 1
    with pytest.raises(ValueError):
        plan_layout([1], 0)
    with pytest.raises(ValueError):
        plan_layout([1], 64, alignment=3)


def test_build_manifest_and_wire_roundtrip():
    m = build_manifest([("a", "float32", (3, 4)), ("b", "bfloat16", (100,)), ("c", "int64", ())], 7, 64)
    assert m.total_bytes == 48 + 200 + 8 and m.version == 7
    assert [t.offset % ALIGNMENT for t in m.tensors] == [0, 0, 0]
    assert check_layout(m) == []
    wire = m.to_wire()
    encoded = msgspec.msgpack.encode(wire)  # what collective_rpc carries: builtins only
    back = Manifest.from_wire(msgspec.msgpack.decode(encoded))
    assert back == m and back.digest() == m.digest()
    assert Manifest.from_wire(m.to_json().decode()) == m
    other = build_manifest([("a", "float32", (3, 4)), ("b", "bfloat16", (100,)), ("c", "int64", ())], 7, 64)
    assert other.digest() != m.digest()  # a fresh push id each time


def test_check_layout_catches_inconsistent_manifests():
    m = build_manifest([("a", "float32", (4,)), ("b", "float32", (4,))], 1, 8)
    bad_size = msgspec.structs.replace(m, tensors=[msgspec.structs.replace(m.tensors[0], nbytes=99), m.tensors[1]])
    assert any("nbytes" in p for p in check_layout(bad_size))
    overlap = msgspec.structs.replace(m, tensors=[m.tensors[0], msgspec.structs.replace(m.tensors[1], offset=0)])
    assert any("overlapping" in p for p in check_layout(overlap))
    for size in (4, m.layout_bytes + 1):  # too small, or claiming more memory than the tensors need
        assert any("layout_bytes says" in p for p in check_layout(msgspec.structs.replace(m, layout_bytes=size)))
    no_buckets = msgspec.structs.replace(m, buckets=[])
    assert any("buckets cover 0 of 2" in p for p in check_layout(no_buckets))
    wrong_bucket = msgspec.structs.replace(m, buckets=[Bucket(0, 10**6, 0, 2)])
    assert any("does not tile" in p for p in check_layout(wrong_bucket))
    dup = build_manifest([("a", "float32", (4,)), ("a", "float32", (4,))], 1, 8)
    assert any("names given twice" in p for p in check_layout(dup))
    bad_dtype = msgspec.structs.replace(m, tensors=[msgspec.structs.replace(m.tensors[0], dtype="float8"),
                                                    m.tensors[1]])
    assert any("unsupported dtype" in p for p in check_layout(bad_dtype))


# -- validation against a model --------------------------------------------------------------
PARAMS = {
    "embed.weight": ParamInfo("float32", (10, 4)),
    "layer.weight": ParamInfo("float32", (4, 4)),
    "layer.bias": ParamInfo("float32", (4,)),
    "steps": ParamInfo("int64", ()),
}
ALIASES = {"head.weight": "embed.weight"}


def _m(specs):
    return build_manifest(specs, 1, 64)


GOOD = [("embed.weight", "float32", (10, 4)), ("layer.weight", "float32", (4, 4)), ("layer.bias", "float32", (4,)),
        ("steps", "int64", ())]


def test_valid_manifest_passes():
    assert validate_manifest(_m(GOOD), PARAMS, ALIASES) == []


def test_tied_weight_may_come_under_its_alias_but_only_once():
    via_alias = [("head.weight", "float32", (10, 4))] + GOOD[1:]
    assert validate_manifest(_m(via_alias), PARAMS, ALIASES) == []
    both = GOOD + [("head.weight", "float32", (10, 4))]
    problems = validate_manifest(_m(both), PARAMS, ALIASES)
    assert len(problems) == 1 and "given twice" in problems[0] and "head.weight (tied to embed.weight)" in problems[0]


def test_every_problem_is_listed():
    specs = [
        ("embed.weight", "float32", (10, 5)),  # wrong shape
        ("layer.weight", "int32", (4, 4)),  # int into a float param
        ("steps", "float32", ()),  # float into an int param
        ("ghost", "float32", (1,)),  # unknown
    ]  # layer.bias missing
    problems = " | ".join(validate_manifest(_m(specs), PARAMS, ALIASES))
    assert "unknown names (1): ghost" in problems
    assert "missing names" in problems and "layer.bias" in problems
    assert "embed.weight [10, 5] != [10, 4]" in problems
    assert "layer.weight int32 -> float32" in problems and "steps float32 -> int64" in problems


def test_long_listings_are_truncated():
    specs = GOOD + [(f"ghost{i}", "float32", (1,)) for i in range(30)]
    (problem,) = validate_manifest(_m(specs), PARAMS, ALIASES)
    assert "unknown names (30)" in problem and "and 22 more" in problem


def test_dtype_policy():
    assert can_take("float32", "float32") and can_take("int64", "int64")
    for a in ("float32", "float16", "bfloat16", "float64"):
        for b in ("float32", "float16", "bfloat16", "float64"):
            assert can_take(a, b)
    assert not can_take("int64", "float32") and not can_take("float32", "int64")
    assert not can_take("int32", "int64") and not can_take("bool", "uint8")


def test_model_params_canonical_names_and_aliases(hf_models):
    params, aliases = model_params(hf_models["qwen2"])
    assert "model.embed_tokens.weight" in params and "lm_head.weight" not in params
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    infos = param_infos(params)
    assert infos["model.embed_tokens.weight"].dtype == "float32"


# -- checksum --------------------------------------------------------------------------------
def test_checksum_skips_tied_duplicates_and_ignores_order(hf_models):
    model = hf_models["qwen2"]
    by_params = weights_checksum(model.named_parameters())
    by_state = weights_checksum(model.state_dict().items())  # has lm_head.weight too, tied
    assert by_params == by_state
    assert weights_checksum(reversed(list(model.named_parameters()))) == by_params
    assert len(dedup_tied(model.state_dict().items())) == len(list(model.parameters()))


def test_checksum_sees_values_names_dtypes():
    a = [("x", torch.arange(6, dtype=torch.float32)), ("y", torch.ones(2, 2))]
    base = weights_checksum(a)
    assert weights_checksum([("x", torch.arange(6, dtype=torch.float32)), ("y", torch.ones(2, 2))]) == base
    assert weights_checksum([("x", torch.arange(6, dtype=torch.float32)), ("z", torch.ones(2, 2))]) != base
    assert weights_checksum([("x", torch.arange(6, dtype=torch.float64)), ("y", torch.ones(2, 2))]) != base
    changed = torch.ones(2, 2)
    changed[1, 1] = 1 + 2**-20
    assert weights_checksum([("x", torch.arange(6, dtype=torch.float32)), ("y", changed)]) != base
    assert weights_checksum([("x", torch.arange(6, dtype=torch.float32)), ("y", torch.ones(4))]) != base
    bf = [("b", torch.ones(3, dtype=torch.bfloat16)), ("e", torch.empty(0))]
    assert weights_checksum(bf) == weights_checksum(list(bf))


# -- names and wrappers ----------------------------------------------------------------------
def test_clean_name():
    assert clean_name("module.model.layers.0.weight") == "model.layers.0.weight"
    assert clean_name("module.module.lm_head.weight") == "lm_head.weight"
    assert clean_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert clean_name("model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert clean_name("model.submodule.weight") == "model.submodule.weight"  # only a leading "module."


def test_wrappers_are_unwrapped_and_tied_weights_sent_once(hf_models):
    model = hf_models["qwen2"]
    plain = [n for n, _ in model.named_parameters()]
    for wrapped in (torch.nn.DataParallel(model), torch.compile(model), torch.nn.DataParallel(torch.compile(model))):
        assert unwrap_model(wrapped) is model
        with named_weights(wrapped) as named:
            assert [n for n, _ in named] == plain
    # a state dict of a wrapped model: prefixes cleaned, the tied lm_head.weight dropped
    sd = torch.nn.DataParallel(model).state_dict()
    assert "module.lm_head.weight" in sd
    with named_weights(sd) as named:
        assert [n for n, _ in named] == plain
    sender = WeightSender(bucket_bytes=2**20)
    m = sender.prepare(torch.nn.DataParallel(model), version=3).manifest
    assert m.names == plain and m.version == 3
    assert m.total_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert sender.checksum(torch.compile(model)) == weights_checksum(model.named_parameters())


def test_sender_cast_dtype_in_manifest(hf_models):
    model = hf_models["qwen2"]
    m = WeightSender(dtype=torch.bfloat16).prepare(model, 1).manifest
    assert {t.dtype for t in m.tensors} == {"bfloat16"}
    assert m.total_bytes == sum(p.numel() * 2 for p in model.parameters())
    infos = param_infos(model_params(model)[0])
    assert validate_manifest(m, infos, model_params(model)[1]) == []  # bf16 -> fp32 is taken
    with pytest.raises(ValueError):
        WeightSender(dtype=torch.int8)


def test_generator_of_pairs_is_listed_once(hf_models):
    model = hf_models["qwen2"]
    gen = ((n, p) for n, p in model.named_parameters())
    prepared = WeightSender().prepare(gen, 1)
    assert len(prepared.manifest.tensors) == len(list(model.parameters()))
    with named_weights(prepared.weights) as named:  # still there to send
        assert len(named) == len(prepared.manifest.tensors)
    with pytest.raises(ValueError, match="two different tensors"):
        WeightSender().prepare([("module.a", torch.ones(1)), ("a", torch.ones(1))], 1)
    assert math.prod(prepared.manifest.tensors[0].shape) == model.model.embed_tokens.weight.numel()


def test_prepare_reuses_the_layout_only_while_nothing_changed(hf_models):
    model = hf_models["qwen2"]
    sender = WeightSender(bucket_bytes=2**20)
    first = sender.prepare(model, 1).manifest
    again = sender.prepare(model, 2).manifest
    assert again.tensors is first.tensors and again.buckets is first.buckets  # the layout was reused
    assert (again.version, first.version) == (2, 1)
    assert again.push_id != first.push_id and again.digest() != first.digest()
    fresh = build_manifest([(t.name, t.dtype, t.shape) for t in first.tensors], 2, 2**20)
    assert (again.tensors, again.buckets, again.layout_bytes) == (fresh.tensors, fresh.buckets, fresh.layout_bytes)
    sender.bucket_bytes = 2**22  # a new bucket size: planned afresh
    wider = sender.prepare(model, 3).manifest
    assert wider.buckets != first.buckets and wider.tensors == first.tensors
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    named[1] = (named[1][0], torch.zeros(3, 5))  # a new shape: planned afresh, and it shows
    changed = sender.prepare(named, 4).manifest
    assert list(changed.tensors[1].shape) == [3, 5] and changed.layout_bytes != wider.layout_bytes
    rebuilt = build_manifest([(t.name, t.dtype, t.shape) for t in changed.tensors], 4, 2**22)
    assert (changed.tensors, changed.buckets) == (rebuilt.tensors, rebuilt.buckets)


def test_a_tensor_of_alone_bytes_or_more_is_a_bucket_of_its_own():
    """So that a trainer whose weights are not flattened sends it from its own memory (no copy)."""
    from weight_sync.common.manifest import ALONE_BYTES

    big, small = ALONE_BYTES, 1000
    sizes = [small, small, big, small, 0, big + 1, big, small, small]
    _, _, buckets = _check_plan(sizes, 64 * 2**20, 256)
    assert [(b.first, b.last) for b in buckets] == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 9)]
