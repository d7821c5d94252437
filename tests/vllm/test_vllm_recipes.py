"""The recipes on `--engine vllm`: the sidecar they start runs vLLM's CPU build, every step's
weights are pushed into it, and the engine and the trainer stay in sync."""

import pytest

pytest.importorskip("vllm")

from recipes import grpo  # noqa: E402
from tests.recipes.test_recipes_e2e import _check_run  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_grpo_on_vllm_keeps_engine_and_trainer_in_sync(qwen2_dir, tmp_path):
    out = tmp_path / "grpo"
    grpo.main(["--model", qwen2_dir, "--engine", "vllm", "--max-steps", "3", "--check-sync", "--output-dir", str(out)])
    rows = _check_run(out, 3)  # the weights' checksums and the sampled tokens' logprobs checked every step
    assert all(r["staleness"] == 0 for r in rows)


@pytest.mark.slow
def test_default_grpo_on_vllm_learns(tmp_path):
    """As tests/recipes' test_default_grpo_learns, on vLLM (5-6 minutes on 2 cores: not in CI)."""
    summary = grpo.main(["--engine", "vllm", "--output-dir", str(tmp_path / "default")])
    assert summary["steps"] == 40
    assert summary["last_reward"] - summary["first_reward"] >= 0.3, summary
