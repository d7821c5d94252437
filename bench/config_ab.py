"""What one engine setting costs, side by side in one run: the same RL-shaped batch (P prompts x n=8,
16-128 prompt tokens, 128 new tokens, temperature 1) through two in-process engines that differ in
one EngineConfig field, alternating rounds, the best round of each counting. The first value is the
anchor the ratio is taken against.

    python -m bench.config_ab                          # the fp32 LM head against bf16's (issue 65 item 3)
    python -m bench.config_ab --model <qwen3-moe-2core> --dtype float32 --field batch_invariant \\
        --values false,true --seqs 256                 # what batch invariance costs fp32 experts (item 1)
"""

from __future__ import annotations

import argparse
import logging
import random
import time

log = logging.getLogger("bench.config_ab")


def _value(text: str):
    return {"true": True, "false": False}.get(text.lower(), text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or directory (default smollm2)")
    ap.add_argument("--dtype", default="bfloat16", help="the engines' dtype")
    ap.add_argument("--field", default="head_dtype", help="the EngineConfig field the two engines differ in")
    ap.add_argument("--values", default="auto,float32", help="its two values, the anchor first (true/false: bools)")
    ap.add_argument("--seqs", default="32,256", help="comma-separated batch sizes in sequences (8 per prompt)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine and size; the best counts")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from engine import LLM, EngineConfig, SamplingParams
    from engine.model_runner import available_cpus
    from engine.models.model_names import resolve_model_arg

    model = resolve_model_arg(args.model)
    sizes = [int(s) for s in args.seqs.split(",")]
    values = [_value(v) for v in args.values.split(",")]
    if len(values) != 2:
        ap.error("--values takes two values")
    llms = [LLM(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=max(sizes), max_model_len=512, seed=0,
                             num_threads=available_cpus(), **{args.field: v})) for v in values]
    for llm in llms:  # timed once their weights are on 2 MB pages, as a long run serves
        collapser = getattr(llm.core.worker, "collapser", None)
        if collapser is not None:
            collapser.idle.wait(600)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=128, ignore_eos=True)
    rng = random.Random(0)
    for seqs in sizes:
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 129))]}
                   for _ in range(max(1, seqs // 8))]
        for llm in llms:
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm
        best = [0.0, 0.0]
        for _ in range(args.rounds):
            for i, llm in enumerate(llms):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                rate = sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0)
                best[i] = max(best[i], rate)
        log.info("%4d seqs, %s: %s=%s %.1f tok/s, %s=%s %.1f tok/s: ratio %.3f", seqs, args.dtype, args.field,
                 values[0], best[0], args.field, values[1], best[1], best[1] / best[0])


if __name__ == "__main__":
    main()
