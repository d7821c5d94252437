"""The recipes end to end: their own sidecar, real pushes, checksums checked after each push."""

import json

import pytest

from recipes import corrections as C
from recipes import grpo, ppo
from recipes.tasks import JsonlTask, final_number
from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance
from tests.recipes import wandb_log

pytestmark = pytest.mark.timeout(600)
# The 40-step runs (the README's GRPO run: about a minute on 2 cores): a hang guard, not a speed
# check. On a machine whose cores other work shares, the trainer and the sidecar process wait their
# turn at each step (up to ~50 s a step seen), and a run past 600 s is slow, not stuck.
forty_steps = pytest.mark.timeout(1800)

TRL_METRICS = ["reward", "reward_std", "kl", "entropy", "clip_ratio", "completions/mean_length",
               "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
               "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
               "sampling/importance_sampling_ratio/max", "sampling/importance_sampling_ratio/capped", "timing/generate", "timing/weight_sync", "timing/train",
               "timing/step", "staleness", "weight_version"]
MISMATCH_METRICS = [f"mismatch/{k}" for k in ("outside_band", "max_abs_log_ratio", "k3_kl", "chi2_token",
                                                "chi2_sequence")] + [f"mismatch/cut/{m}" for m in C.MODES]


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _mean_logprob_tolerance(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    return fp32_logprob_tolerance(model.config, activation_magnitude(model, ids), "mean")


def _check_run(out_dir, steps):
    rows = _rows(out_dir)
    assert len(rows) == steps and all(m in rows[0] for m in TRL_METRICS + MISMATCH_METRICS)
    # the engine's sampled-token logprobs equal the trainer's forward (fp32) after every push,
    # within what fp32 rounding explains at the trained model's magnitudes
    tol = _mean_logprob_tolerance(out_dir / "checkpoint-final")
    assert all(r["sampling/sampling_logp_difference/mean"] <= tol for r in rows), tol
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))
    assert (out_dir / "checkpoint-final" / "model.safetensors").exists()
    assert (out_dir / "reward_curve.png").stat().st_size > 1000
    return rows


def test_grpo_short_run_keeps_engine_and_trainer_in_sync(qwen2_dir, tmp_path):
    out = tmp_path / "grpo"
    grpo.main(["--model", qwen2_dir, "--max-steps", "3", "--check-sync", "--output-dir", str(out),
               "--beta", "0.01", "--loss-agg", "seq-mean-token-mean"])
    rows = _check_run(out, 3)
    assert all(r["staleness"] == 0 for r in rows)


def test_grpo_with_delta_pushes_into_a_bf16_sidecar_matches_every_step(qwen2_dir, tmp_path):
    """--delta on: after the first (full) push every step's push carries only what changed, and the
    sidecar's weights equal the trainer's (in bf16) after each one (--check-sync raises if not); its
    LM head in fp32 (a derived copy each push stages)."""
    out = tmp_path / "delta"
    grpo.main(["--model", qwen2_dir, "--max-steps", "3", "--check-sync", "--output-dir", str(out),
               "--sidecar-dtype", "bfloat16", "--delta", "on", "--sidecar-head-dtype", "float32"])
    rows = _rows(out)
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["weight_sync/delta"] == 1 and 0 < r["weight_sync/bytes"] < r["weight_sync/full_bytes"]
               for r in rows), [(r["weight_sync/bytes"], r["weight_sync/full_bytes"]) for r in rows]


def test_ppo_short_run_logs_every_step_to_wandb(qwen2_dir, tmp_path, monkeypatch):
    """With --report-to wandb (offline) the run file holds every logged step, as metrics.jsonl."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "ppo"
    ppo.main(["--model", qwen2_dir, "--max-steps", "3", "--check-sync", "--output-dir", str(out),
              "--epochs", "2", "--minibatches", "2", "--report-to", "wandb"])
    rows = _check_run(out, 3)
    assert all(r["value_loss"] >= 0 for r in rows)
    _check_wandb(out, rows)


def _check_wandb(out, rows):
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    logged = wandb_log.history(run_file)
    assert [h["_step"] for h in logged] == list(range(1, len(rows) + 1))
    assert [h["reward"] for h in logged] == [r["reward"] for r in rows]
    assert all(h["value_loss"] == r["value_loss"] for h, r in zip(logged, rows))


@pytest.mark.slow  # 1-2 min on 2 cores; CI has the 3-step run with wandb and GRPO's 40 steps
@forty_steps
def test_ppo_learns_on_the_default_task_and_logs_to_wandb(tmp_path, monkeypatch):
    """PPO with its defaults on the embedded model: the reward rises and the critic learns (its
    loss falls); with --report-to wandb (offline) the run file holds every logged step."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "ppo"
    summary = ppo.main(["--output-dir", str(out), "--report-to", "wandb"])
    rows = _rows(out)
    assert summary["steps"] == 40 and summary["last_reward"] - summary["first_reward"] >= 0.3, summary
    value_loss = [r["value_loss"] for r in rows]
    assert sum(value_loss[-10:]) < 0.5 * sum(value_loss[:10]), value_loss
    _check_wandb(out, rows)


def test_async_grpo_is_one_step_stale(qwen2_dir, tmp_path):
    """--async with IcePop's correction: the weights see the one-step-stale policy (the trainer's
    pre-update logprobs against the engine's, far beyond fp32 rounding), and the share the run's
    correction cut is the share IcePop cuts at its band among the ones logged for every mode."""
    out = tmp_path / "async"
    grpo.main(["--model", qwen2_dir, "--max-steps", "4", "--check-sync", "--output-dir", str(out), "--async",
               "--is-mode", "icepop"])
    rows = _rows(out)
    assert len(rows) == 4 and max(r["staleness"] for r in rows) <= 1 and rows[-1]["staleness"] == 1
    stale = [r for r in rows if r["staleness"] == 1]
    assert all(r["sampling/sampling_logp_difference/mean"] > 10 * _mean_logprob_tolerance(out / "checkpoint-final")
               for r in stale)
    assert all(m in r for r in rows for m in MISMATCH_METRICS)
    assert all(r["sampling/importance_sampling_ratio/capped"] == r["mismatch/cut/icepop"] for r in rows)
    assert all(r["mismatch/k3_kl"] > 0 and r["mismatch/max_abs_log_ratio"] > 0 for r in stale)


@forty_steps
def test_default_grpo_learns(tmp_path):
    """The README's main job: the embedded tiny model, defaults, reward rising by >= 0.3."""
    summary = grpo.main(["--output-dir", str(tmp_path / "default")])
    assert summary["steps"] == 40
    assert summary["last_reward"] - summary["first_reward"] >= 0.3, summary


def test_jsonl_task_exact_match(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n"
                    + json.dumps({"prompt": "Half of 1,000?", "answer": "500"}) + "\n")
    task = JsonlTask(str(path))
    items = sorted(task.items, key=lambda d: d["answer"])
    assert [i["answer"] for i in items] == ["5", "500"]
    assert task.reward(items[0], [], "so the answer is 5.") == 1.0
    assert task.reward(items[0], [], "it is 6") == 0.0
    assert task.reward(items[1], [], "#### 500") == 1.0
    assert final_number("1,234.5 then 7") == "7" and final_number("no digits") is None
    with pytest.raises(ValueError, match="needs"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"q": 1}) + "\n")
        JsonlTask(str(bad))


@pytest.mark.parametrize("algo,extra", [  # PPO's two ranks share GRPO's path but for the critic: not in CI
    ("grpo", []), pytest.param("ppo", ["--epochs", "2", "--minibatches", "2"], marks=pytest.mark.slow)])
def test_two_trainer_ranks_train_and_push(qwen2_dir, tmp_path, algo, extra):
    """torchrun with 2 ranks (gloo, DDP): rank 0 owns the sidecar, the other gets the rollouts
    from it and follows its pushes; after every push the engine holds exactly the trainer's
    weights (--check-sync) and matches its forward."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"{algo}2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "-m", f"recipes.{algo}", "--model", qwen2_dir, "--max-steps", "3",
           "--check-sync", "--output-dir", str(out), "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd(), "WANDB_MODE": "offline"})
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # leave no rank behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    _check_run(out, 3)


@pytest.mark.slow  # 1-2 min on 2 cores; CI has LoRA's 3-step run, its sync check and its adapter
@forty_steps
def test_lora_grpo_learns_and_saves_the_adapter(tmp_path):
    """--lora-r on the default task: only the adapter trains and moves (--check-sync: after each
    push the engine's weights equal the trainer's merged model, bit for bit), the reward rises,
    and the checkpoint is a PEFT adapter that loads over the base."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.models.model_names import resolve_model_arg

    out = tmp_path / "lora"
    summary = grpo.main(["--output-dir", str(out), "--lora-r", "8", "--check-sync"])
    rows = _rows(out)
    assert summary["steps"] == 40
    assert summary["last_reward"] - summary["first_reward"] >= 0.3, summary
    ckpt = out / "checkpoint-final"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(resolve_model_arg("tiny"), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, ckpt).merge_and_unload()
    # the engine's sampled-token logprobs equal the trainer's forward within fp32 rounding
    ids = torch.randint(3, merged.config.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    tol = fp32_logprob_tolerance(merged.config, activation_magnitude(merged, ids), "mean")
    assert all(r["sampling/sampling_logp_difference/mean"] <= tol for r in rows), tol


def test_lora_ppo_short_run_saves_an_adapter_that_loads_over_the_base(qwen2_dir, tmp_path):
    """--check-sync: after each push the engine's weights equal the trainer's merged model, bit
    for bit; the checkpoint is a PEFT adapter alone, and base + adapter is the policy the engine
    sampled from (its sampled-token logprobs equal that model's forward within fp32 rounding)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ppo-lora"
    ppo.main(["--model", qwen2_dir, "--max-steps", "3", "--check-sync", "--output-dir", str(out), "--lora-r", "4",
              "--lora-target-modules", "q_proj,v_proj", "--rslora"])
    rows = _rows(out)
    assert len(rows) == 3 and all(r["value_loss"] >= 0 for r in rows)
    ckpt = out / "checkpoint-final"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, ckpt).merge_and_unload()
    ids = torch.randint(3, merged.config.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    tol = fp32_logprob_tolerance(merged.config, activation_magnitude(merged, ids), "mean")
    assert all(r["sampling/sampling_logp_difference/mean"] <= tol for r in rows), tol


def test_grpo_on_a_mixture_of_experts_keeps_engine_and_trainer_in_sync(moe_dirs, tmp_path):
    """The tiny Qwen3-MoE (`--model tiny-moe`'s recipe): the sidecar on its own MoE layers, the trainer
    on transformers', the pushes' fused expert tensors checked after each step."""
    out = tmp_path / "grpo-moe"
    grpo.main(["--model", moe_dirs["qwen3_moe"], "--max-steps", "3", "--check-sync", "--output-dir", str(out)])
    rows = _check_run(out, 3)
    assert all(r["staleness"] == 0 for r in rows)
    assert all(0 <= r["routing/mismatch"] <= 1 for r in rows)  # the routes are asked for and compared


def test_routing_replay_brings_the_trainers_logprobs_to_the_engines(moe_dirs, tmp_path):
    """A bf16 sidecar routes some tokens otherwise than the fp32 trainer would (routing/mismatch > 0);
    with --routing-replay the trainer's forwards take the engine's experts, and the first step's
    rollouts (the same tokens either way: same seed, same initial weights) score closer to the
    engine's logprobs than without."""
    firsts = {}
    for replay in (False, True):
        out = tmp_path / f"replay-{replay}"
        grpo.main(["--model", moe_dirs["qwen3_moe"], "--max-steps", "1", "--output-dir", str(out),
                   "--sidecar-dtype", "bfloat16", *(["--routing-replay"] if replay else [])])
        firsts[replay] = _rows(out)[0]
    assert firsts[False]["routing/mismatch"] > 0 and firsts[True]["routing/mismatch"] == firsts[False]["routing/mismatch"]
    diff = "sampling/sampling_logp_difference/mean"
    assert firsts[True][diff] < firsts[False][diff], (firsts[True][diff], firsts[False][diff])
