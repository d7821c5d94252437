"""Pushes into mixture-of-experts engines (engine/models/moe_model.py): the trainer is this pytest process,
the engines real AsyncEngines (bf16 and fp32) on the tiny Qwen3-MoE over one gloo group. What a
transformers 5 trainer holds (each layer's experts fused into two 3-D tensors) lands bit for bit,
and so does a checkpoint's per-expert naming (stacked on the way); a delta after them is exact; a
push whose expert tensor has the wrong shape is refused and changes nothing."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.weight_sync.test_delta_push import (  # noqa: F401 - sender, group: fixtures this module uses
    _greedy, bf16_and_fp32_engines, full_then_delta_land_exactly, group, run, sender, served,
)
from weight_sync import WeightSyncError
from weight_sync.engine_side.engines import engines_checksums
from weight_sync.trainer.local_engines import push_to_engines

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engines(moe_dir, loop):
    yield from bf16_and_fp32_engines(moe_dir)


@pytest.fixture(scope="module")
def trainer(moe_dir):
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def test_fused_experts_land_bit_for_bit_then_a_delta(engines, trainer, sender, group, loop):
    assert any(n.endswith("experts.gate_up_proj") for n, _ in trainer.named_parameters())
    full_then_delta_land_exactly(engines, sender, trainer, loop)


def test_per_expert_names_land_as_the_fused_tensors(engines, trainer, sender, group, moe_dir, loop):
    """A checkpoint's per-expert tensors (what transformers 4 named, and what save_pretrained writes)
    pushed as they are: the engines hold exactly the fused model they make."""
    state = load_file(f"{moe_dir}/model.safetensors")
    assert any(".experts.0.up_proj." in n for n in state)
    run(loop, push_to_engines(engines, sender, list(state.items()), 3))
    fresh = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    assert run(loop, engines_checksums(engines)) == served(fresh)


def test_a_wrong_expert_shape_is_refused_and_changes_nothing(engines, trainer, sender, group, loop):
    before = run(loop, engines_checksums(engines))
    named = [(n, p.detach()) for n, p in trainer.named_parameters()]
    i = next(k for k, (n, _) in enumerate(named) if n.endswith("experts.down_proj"))
    named[i] = (named[i][0], torch.zeros(7, *named[i][1].shape[1:]))  # 7 experts where the engine has 8
    with pytest.raises(WeightSyncError) as err:
        run(loop, push_to_engines(engines, sender, named, 4))
    assert err.value.refused and named[i][0] in str(err.value)
    assert run(loop, engines_checksums(engines)) == before
    assert all(len(run(loop, _greedy(e, [5, 6, 7], 3))) == 3 for e in engines)  # both still serve
