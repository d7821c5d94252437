"""--seed end to end: it reaches the sidecar and every request's sampling, so two runs with the
same seed give the same first-step rollouts, and another seed others."""

import json

from recipes import grpo
from recipes.seeds import MAX_SAMPLES, request_seed


def test_request_seeds_are_stable_distinct_and_leave_room_for_n():
    seeds = {request_seed(s, c, i) for s in range(3) for c in range(20) for i in range(50)}
    assert len(seeds) == 3 * 20 * 50
    assert all(x % MAX_SAMPLES == 0 and 0 <= x < 2**63 for x in seeds)
    assert request_seed(7, 3, 2) == request_seed(7, 3, 2)


def _first_step(model_dir, out, seed):
    grpo.main(["--model", model_dir, "--max-steps", "1", "--output-dir", str(out), "--seed", str(seed),
               "--log-completions", "100", "--report-to", "none"])
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return [(r["prompt"], r["token_ids"]) for r in rows if r["step"] == 1]


def test_same_seed_same_first_step_rollouts(qwen2_dir, tmp_path):
    a = _first_step(qwen2_dir, tmp_path / "a", 5)
    b = _first_step(qwen2_dir, tmp_path / "b", 5)
    c = _first_step(qwen2_dir, tmp_path / "c", 6)
    assert len(a) == 64 and a == b  # 8 prompts x n=8
    assert [t for _, t in a] != [t for _, t in c]
