"""What `--on-policy exact` costs a training step (issue 65: goal <= 1.5x the plain step; vLLM + TorchTitan's
bitwise mode is 2.4x by their blog, not measured here): a GRPO step's forward + backward over one batch of
rollouts, plain (the trainer's own logprobs) against exact (the same, plus the trainer's weights loaded into
the engine's arithmetic and the rollouts scored there: engine/exact_logprobs.py, recipes/exact_policy.py),
side by side in one run, each the median of --repeats.

    python -m bench.exact_cost                            # smollm2, a bf16 engine, 8 prompts x 4, 64 tokens
    python -m bench.exact_cost --engine fp32 --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

log = logging.getLogger("bench.exact_cost")


def rollouts(model_dir: str, engine: str, prompts: int, n: int, max_tokens: int) -> list:
    from bench.fidelity import engine_config
    from engine import LLM, SamplingParams
    from recipes.tasks import ArithmeticTask
    from engine.tokenizer import load_tokenizer
    from rollout.common.types import Rollout

    task = ArithmeticTask(load_tokenizer(model_dir), level=1, seed=0)
    llm = LLM(engine_config(model_dir, engine))
    outs = llm.generate([it["prompt"] for it in task.prompts(prompts)],
                        SamplingParams(n=n, max_tokens=max_tokens, seed=0, ignore_eos=True), use_tqdm=False)
    return [Rollout(o.prompt_token_ids, c.token_ids, c.logprobs, "", "length", [0] * len(c.token_ids))
            for o in outs for c in o.outputs]


def step(policy, batch, scorer=None) -> dict:
    """One GRPO-shaped forward + backward (the clipped loss at ratio 1); with `scorer`, exact mode's."""
    from recipes import losses as L
    from recipes.batch import completion_logits, token_logprobs
    from recipes.exact_policy import padded, straight_through

    t0 = time.perf_counter()
    policy.zero_grad(set_to_none=True)
    logp = token_logprobs(completion_logits(policy, batch)[0], batch.targets)
    t1 = time.perf_counter()
    times = {}
    if scorer is not None:
        scorer.load_weights((n, p.detach()) for n, p in policy.named_parameters())
        t2 = time.perf_counter()
        values = scorer.logprobs([r.prompt_token_ids for r in batch.rollouts], [r.token_ids for r in batch.rollouts])
        logp = straight_through(logp, padded(values, logp.shape[1]))
        times = {"load": t2 - t1, "score": time.perf_counter() - t2}
    adv = torch.linspace(-1, 1, logp.shape[0])
    pg, _ = L.clipped_policy_loss(logp, logp.detach(), adv, batch.mask)
    L.aggregate(pg, batch.mask, "token-mean", 0).backward()
    return {"total": time.perf_counter() - t0, "forward": t1 - t0, **times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or directory (a dense family our layers serve)")
    ap.add_argument("--engine", default="bf16", choices=["fp32", "bf16", "bf16+fp32head", "int8"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="samples a prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers import AutoModelForCausalLM

    from bench.fidelity import engine_config
    from engine.exact_logprobs import ExactLogprobs
    from engine.models.model_names import resolve_model_arg
    from recipes.batch import build_batch

    model_dir = resolve_model_arg(args.model)
    sampled = rollouts(model_dir, args.engine, args.prompts, args.n, args.max_tokens)
    batch = build_batch(sampled, 0)
    batch.rollouts = sampled
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scorer = ExactLogprobs(engine_config(model_dir, args.engine))
    runs = {"plain": [], "exact": []}
    for _ in range(args.repeats):  # alternated: a slow stretch of the machine hits both
        runs["plain"].append(step(policy, batch))
        runs["exact"].append(step(policy, batch, scorer))
    tokens = int(batch.mask.sum())
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    log.info("%s, %s engine, %d rollouts, %d completion tokens, median of %d:", args.model, args.engine,
             len(batch.rollouts), tokens, args.repeats)
    log.info("plain: %.2f s a step (forward %.2f s)", med["plain"]["total"], med["plain"]["forward"])
    log.info("exact: %.2f s a step (forward %.2f s, weights loaded %.2f s, rollouts scored %.2f s)",
             med["exact"]["total"], med["exact"]["forward"], med["exact"]["load"], med["exact"]["score"])
    log.info("exact / plain: %.2fx (goal <= 1.5x)", med["exact"]["total"] / med["plain"]["total"])


if __name__ == "__main__":
    main()
