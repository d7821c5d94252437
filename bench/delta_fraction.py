"""What changes from one push to the next (issue 38, item 1): the fraction of a bf16 engine's
weights whose bits change after each optimizer step, and what a delta push would send for it.

A trainer in fp32 (the recipes' AdamW, weight_decay 0) takes --steps steps of a causal-LM loss on
a fixed batch at each learning rate; before and after each step its weights are cast to the wire
dtype (what a bf16 engine receives) and compared bit for bit (weight_sync.common.delta). Printed per
model and learning rate: the fraction changed at step 1 (AdamW's first step is unusual: its update
is lr * sign(g) for every element), at step 2, the median of steps 2..N, and over all N steps (what
a delta against an anchor N pushes old carries); and the bytes a delta of a median step sends
against the full push (positions as int32 indices or a bitmap per tensor, whichever is smaller).

    python -m bench.delta_fraction                              # tiny and SmolLM2, lr 1e-6..1e-4
    python -m bench.delta_fraction --models tiny --steps 4      # a quick look
"""

from __future__ import annotations

import argparse
import logging
import statistics

import torch
from tqdm import tqdm

from weight_sync.common.delta import changed_positions, encoded_bytes

log = logging.getLogger("bench.delta_fraction")


def wire(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(dtype).clone() for n, p in model.named_parameters()}


def compare(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
    """Elements changed, all elements, and the bytes of the best delta and of the full push."""
    changed = total = delta = full = 0
    for name, t in new.items():
        k = changed_positions(old[name], t).numel()
        cost = encoded_bytes(t.numel(), k, t.element_size())
        changed, total = changed + k, total + t.numel()
        delta, full = delta + min(cost.values()), full + cost["full"]
    return {"fraction": changed / total, "delta_bytes": delta, "full_bytes": full}


def run(model_dir: str, lr: float, steps: int, wire_dtype: torch.dtype, batch: int, seq: int, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    anchor = previous = wire(model, wire_dtype)
    per_step = []
    for _ in tqdm(range(steps), desc=f"lr {lr:g}", leave=False):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = wire(model, wire_dtype)
        per_step.append(compare(previous, now))
        previous = now
    return {"steps": per_step, "over_all": compare(anchor, previous)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2", help="model names (tiny, small, smollm2) or directories")
    p.add_argument("--lrs", default="1e-6,1e-5,1e-4", help="learning rates (the recipes' default for real models: 1e-5)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per learning rate")
    p.add_argument("--wire-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.models.model_names import resolve_model_arg

    dtype = getattr(torch, args.wire_dtype)
    rows = []
    for name in args.models.split(","):
        model_dir = resolve_model_arg(name)
        for lr in (float(x) for x in args.lrs.split(",")):
            r = run(model_dir, lr, args.steps, dtype, args.batch, args.seq, seed=0)
            later = r["steps"][1:] or r["steps"]
            med = statistics.median(s["fraction"] for s in later)
            med_ratio = statistics.median(s["delta_bytes"] / s["full_bytes"] for s in later)
            rows.append((name, lr, r["steps"][0]["fraction"], later[0]["fraction"], med, r["over_all"]["fraction"],
                         med_ratio, r["over_all"]["delta_bytes"] / r["over_all"]["full_bytes"]))
            log.info("%s lr %g: step 1 %.2f%%, median of steps 2..%d %.2f%%", name, lr, 100 * rows[-1][2],
                     args.steps, 100 * med)
    print(f"\n{args.wire_dtype} wire, fp32 AdamW trainer, {args.steps} steps of a causal-LM loss "
          f"(batch {args.batch} x {args.seq} tokens)")
    print(f"{'model':>10} {'lr':>7} {'step 1':>7} {'step 2':>7} {'median':>7} {'over all':>8} {'delta/full':>10} "
          f"{'over all':>8}")
    print(f"{'':>10} {'':>7} {'% chg':>7} {'% chg':>7} {'% chg':>7} {'% chg':>8} {'a step':>10} {'d/full':>8}")
    for name, lr, s1, s2, med, over, ratio, over_ratio in rows:
        print(f"{name:>10} {lr:>7g} {100 * s1:>7.2f} {100 * s2:>7.2f} {100 * med:>7.2f} {100 * over:>8.2f} "
              f"{ratio:>10.3f} {over_ratio:>8.3f}")


if __name__ == "__main__":
    main()
