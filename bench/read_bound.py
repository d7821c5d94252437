"""The memory read bound of a rollout workload: the least time a decode-bound run can take on a
machine that reads memory at `bandwidth` bytes/s, because every decode step reads every weight once
(all sequences of the batch share the read) and each sequence's KV cache once. bench.engines prints
each run's share of it (bound / measured): near 1, the run is as fast as reading allows; the rest
of the time went to compute, threads waiting, or the host.

Counted for a workload whose sequences all run in one batch (its size within max_num_seqs) and
start together: the steps are the longest request's max_tokens; a sequence of prompt length p
asked for m tokens reads the KV of p + j tokens at its j-th decode step (j = 1 .. m - 1; its first
token comes from the prefill, which reads the weights once more). Prefill's own compute is not
counted: a lower bound, not an estimate."""

from __future__ import annotations

import json
from pathlib import Path


def kv_bytes_per_token(config: dict, itemsize: int) -> int:
    """Bytes of K and V one token holds over all layers."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * itemsize


def read_bytes(prompt_lens: list[int], max_tokens: list[int], n: int, weight_bytes: int, kv_per_token: int) -> int:
    """Bytes a run of the workload must read: the weights once per step (prefill included), each
    sequence's KV once per decode step. `prompt_lens` and `max_tokens` per prompt, n sequences each."""
    steps = 1 + max(max_tokens) - 1  # one prefill, then decode steps until the longest request ends
    kv = sum(n * sum(p + j for j in range(1, m)) for p, m in zip(prompt_lens, max_tokens))
    return steps * weight_bytes + kv * kv_per_token


def model_bytes(model_dir: str, num_params: int, itemsize: int) -> tuple[int, int]:
    """(weight bytes a step reads, KV bytes a token) of the model directory served in a dtype of
    `itemsize` bytes: every parameter (a tied head counted once: the embedding's lookup reads a few
    rows, the head all of them)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return num_params * itemsize, kv_bytes_per_token(config, itemsize)
