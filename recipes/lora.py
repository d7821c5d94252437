"""LoRA training for the recipes (`--lora-r`): the policy trains a PEFT adapter over its frozen
base, each push sends only the adapter (weight_sync/common/lora.py), and checkpoints save the adapter in
PEFT's format (`PeftModel.from_pretrained(base, checkpoint)` loads it)."""

from __future__ import annotations

import argparse

import torch


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank; 0 trains every weight")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (None: 2 x rank)")
    p.add_argument("--lora-target-modules", default="all-linear",
                   help="comma-separated module names to adapt (q_proj,v_proj,...), or all-linear: every linear "
                        "layer but the output head")
    p.add_argument("--lora-push", default="adapter", choices=["adapter", "merged"],
                   help="what each push sends: the adapter (a few MB) or the merged weights")
    p.add_argument("--rslora", action="store_true", help="rank-stabilised LoRA: scale alpha / sqrt(r)")


def wrap_lora(policy: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """The policy as a PEFT LoRA model (only the adapter trains), or itself when --lora-r is 0."""
    if not args.lora_r:
        return policy
    if args.lora_r < 0:
        raise ValueError(f"--lora-r must be >= 0, got {args.lora_r}")
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules
    targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r, target_modules=targets,
                        lora_dropout=0.0, bias="none", use_rslora=args.rslora, task_type="CAUSAL_LM")
    return get_peft_model(policy, config)
