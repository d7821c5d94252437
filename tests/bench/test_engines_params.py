"""bench/engines.py's FLOP count: a mixture of experts' token multiplies by its active experts only."""

import torch
from transformers import AutoConfig

from bench.engines import active_params, count_params
from engine.models import moe_model


def test_an_moe_counts_its_active_experts_and_a_dense_model_everything(moe_dir, qwen2_dir):
    model = moe_model.load(moe_dir, torch.float32)
    cfg = AutoConfig.from_pretrained(moe_dir)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    assert experts > 0 and count_params(moe_dir) == total
    assert active_params(moe_dir) == total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    assert active_params(qwen2_dir) == count_params(qwen2_dir)
