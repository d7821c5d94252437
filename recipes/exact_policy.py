"""`--on-policy exact`: the trainer's logprobs of a rollout are the engine's, bit for bit (issue 65 item 2).

The values come from engine/exact_logprobs.py: the sidecar's engine rebuilt in this process (same
model directory, dtype, head dtype, 8-bit copies), given the trainer's weights as a push commits
them (full weights cast, a LoRA adapter merged as the engine merges it), running the rollout's steps
on the engine's kernels. The gradients are torch's: `straight_through(reference, exact)` is `exact`'s
bits in the forward and passes the gradient to `reference` (the trainer's own logprobs of the same
weights) in the backward. The two forwards differ by rounding only (bench.fidelity: 0.00% of tokens
outside [0.9, 1.1] for fp32, 7.7% for bf16), which is the gradient's error beside the exact values.

So the first minibatch's ratio is exactly 1 and the rollout's importance weights are exactly 1 (no
correction cuts a token): `sampling/sampling_logp_difference/max` logs 0.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("recipes")


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, reference: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        return exact.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def straight_through(reference: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """`exact`'s values (its bits: no arithmetic on them) with `reference`'s gradient."""
    if reference.shape != exact.shape:
        raise ValueError(f"reference {tuple(reference.shape)} and exact {tuple(exact.shape)} logprobs differ in shape")
    return _StraightThrough.apply(reference, exact.to(reference.device, reference.dtype))


def padded(values: list[torch.Tensor], width: int) -> torch.Tensor:
    """Each rollout's logprobs as a row of [len(values), width] (fp32), 0 past its completion: a Batch's layout."""
    out = torch.zeros(len(values), width)
    for k, v in enumerate(values):
        out[k, : len(v)] = v
    return out


def refusal(args) -> str | None:
    """Why `--on-policy exact` cannot run with these flags (None: it can)."""
    if args.engine != "native":
        return "--engine vllm: the exact logprobs are our engine's arithmetic, not vLLM's"
    if (args.sidecar_device or "cpu") != "cpu" or args.device != "cpu":
        return "the exact logprobs run our engine's CPU kernels: a CPU trainer and sidecar (--device cpu)"
    if not args.temperature > 0:
        return f"--temperature {args.temperature}: exact logprobs are a sampled token's (temperature > 0)"
    return None


class ExactPolicy:
    """The engine's logprobs of a run's rollouts under the trainer's current weights."""

    def __init__(self, model_dir: str, args):
        from engine.config import EngineConfig
        from engine.exact_logprobs import ExactLogprobs
        from recipes.rollout_source import SIDECAR_MAX_NUM_SEQS

        # the sidecar's max_num_seqs: it picks the bf16 kernels on some CPUs (rollout_source.SIDECAR_MAX_NUM_SEQS)
        cfg = EngineConfig(model=model_dir, dtype=args.sidecar_dtype, quantization=args.sidecar_quantization,
                           head_dtype=args.sidecar_head_dtype, max_model_len=1024, kv_cache_memory_gb=1.0,
                           max_num_seqs=SIDECAR_MAX_NUM_SEQS, num_threads=torch.get_num_threads())
        self.scorer = ExactLogprobs(cfg)
        self.lora_push = args.lora_push
        self.temperature = args.temperature
        self._stamp = None  # what the scorer's weights were loaded from (see _weights_stamp)
        self._whole = None  # (stamp, rollouts, width, [B, width]): the last whole batch's, for its minibatches

    def logprobs(self, policy: torch.nn.Module, rollouts: list, rows: list[int], width: int) -> torch.Tensor:
        """[len(rows), width] (fp32, 0 past each completion): rollouts[rows]' logprobs under `policy`'s weights."""
        self._load(policy)
        whole = self._whole
        if whole is not None and whole[0] == self._stamp and whole[1] is rollouts and whole[2] == width:
            return whole[3][rows]  # weights unchanged since the batch was scored (PPO's first minibatch)
        picked = [rollouts[i] for i in rows]
        values = self.scorer.logprobs([r.prompt_token_ids for r in picked], [r.token_ids for r in picked],
                                      self.temperature)
        out = padded(values, width)
        self._whole = (self._stamp, rollouts, width, out) if len(rows) == len(rollouts) else None
        return out

    def _load(self, policy: torch.nn.Module) -> None:
        """The policy's weights as the sidecar's commit holds them, unless they are loaded already."""
        from weight_sync.common.lora import A_SUFFIX, B_SUFFIX
        from weight_sync.trainer.lora_push import AdapterPush, push_source
        from weight_sync.trainer.weights import named_weights

        stamp = _weights_stamp(policy)
        if stamp == self._stamp:
            return
        source = push_source(policy, self.lora_push)
        if isinstance(source, AdapterPush):
            named, spec = source.listing()
            tensors = dict(named)
            self.scorer.load_adapter({m: (tensors[m + A_SUFFIX], tensors[m + B_SUFFIX], s)
                                      for m, s in spec.scales.items()})
        else:
            with named_weights(source) as pairs:
                self.scorer.load_weights(pairs)
        self._stamp = stamp


def _weights_stamp(policy: torch.nn.Module) -> tuple:
    """What changes when an optimizer step (or a load) writes the weights: each parameter's address and
    version counter."""
    return tuple((p.data_ptr(), p._version) for p in policy.parameters())
