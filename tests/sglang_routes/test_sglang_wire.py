"""SGLang's update call as manifests (weight_sync/sglang/wire.py): a tied weight a trainer sends
besides its parameter (TorchRL sends its state dict) gets a part of its own, in broadcast order."""

import pytest

from weight_sync.sglang.wire import tied_aliases, update_parts

SERVED = {"model.embed_tokens.weight", "model.norm.weight"}
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def _body(names, shapes=None, **extra):
    shapes = shapes or [[4, 2]] * len(names)
    return {"names": names, "dtypes": ["float32"] * len(names), "shapes": shapes, **extra}


def test_the_tied_output_embedding_is_an_alias_only_where_the_config_ties_it():
    assert tied_aliases(True, SERVED) == TIED
    assert tied_aliases(False, SERVED) == {}
    assert tied_aliases(True, SERVED | {"lm_head.weight"}) == {}  # served on its own: not tied


def test_a_tied_weight_named_with_its_parameter_is_a_part_of_its_own():
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    parts = update_parts(_body(names), 3, TIED)
    assert [m.names for m in parts] == [names[:1], names[1:2], names[2:]]
    assert all(m.partial and m.version == 3 for m in parts)
    alone = update_parts(_body(["lm_head.weight", "model.norm.weight"]), 3, TIED)  # its parameter not in the call
    assert [m.names for m in alone] == [["lm_head.weight", "model.norm.weight"]]
    flat = update_parts(_body(names, load_format="flattened_bucket"), 3, TIED)  # one broadcast: cannot split
    assert [m.names for m in flat] == [names]


def test_a_tied_weight_whose_shape_is_not_its_parameters_is_refused_by_name():
    with pytest.raises(ValueError, match=r"lm_head.weight float32 \[4, 3\] != model.embed_tokens.weight"):
        update_parts(_body(["model.embed_tokens.weight", "lm_head.weight"], [[4, 2], [4, 3]]), 1, TIED)
    with pytest.raises(ValueError, match="shapes: lm_head.weight"):
        update_parts(_body(["lm_head.weight"], [["x"]]), 1, TIED)
