"""Pushes into the engine's own layers of today's dense families (engine/models/llama_model.py,
gemma_model.py): Qwen3 (its per-head q/k norms are weights a push carries), Llama 3 (a scaled rope:
nothing to push, but the tables the engine keeps must survive the push), Gemma 3 (four norms a layer
and q/k norms, each scaling by 1 + w: the pushed w, not 1 + w) and Phi-3 (q/k/v and gate/up one linear each,
pushed under HF's fused names). The trainer is this pytest process, the engines real
AsyncEngines (bf16 and fp32) over one gloo group: a full push and a delta after it land bit for bit
(the digest), and the fp32 engine then decodes as HF does on the pushed weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.weight_sync.test_delta_push import (  # noqa: F401 - group: a fixture this module uses
    TIMEOUT_S, bf16_and_fp32_engines, full_then_delta_land_exactly, group,
)
from weight_sync import WeightSender

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["qwen3", "llama3", "gemma3", "phi3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def engines(tiny_dirs, arch, loop):
    yield from bf16_and_fp32_engines(tiny_dirs[arch])


@pytest.fixture(scope="module")
def sender(arch):
    """A group of its own for each family's engines."""
    s = WeightSender(bucket_bytes=1 << 18, timeout_s=TIMEOUT_S, dtype=torch.bfloat16)
    yield s
    s.close_group()


@pytest.fixture(scope="module")
def trainer(tiny_dirs, arch):
    return AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()


def test_a_full_push_then_a_delta_land_bit_for_bit(engines, trainer, arch, sender, group, loop):
    if arch in ("qwen3", "gemma3"):
        assert any(n.endswith("self_attn.q_norm.weight") for n, _ in trainer.named_parameters())
    if arch == "phi3":
        assert any(n.endswith("self_attn.qkv_proj.weight") for n, _ in trainer.named_parameters())
    full_then_delta_land_exactly(engines, sender, trainer, loop)
