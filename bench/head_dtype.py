"""What the fp32 LM head costs a bf16 engine (issue 65 item 3; engine/kernels/fp32_head.py): the same
RL-shaped batch (P prompts x n=8, 16-128 prompt tokens, 128 new tokens, temperature 1) through two
in-process engines, bf16 with its head in bf16 (the anchor) and in fp32, alternating rounds, the
best round of each counting. What the fp32 head buys is bench.fidelity's `bf16+fp32head` row.

    python -m bench.head_dtype                         # smollm2, 32 and 256 sequences
    python -m bench.head_dtype --model <dir> --seqs 32 --rounds 5
"""

from __future__ import annotations

import argparse
import logging
import random
import time

log = logging.getLogger("bench.head_dtype")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or directory (default smollm2)")
    ap.add_argument("--seqs", default="32,256", help="comma-separated batch sizes in sequences (8 per prompt)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine and size; the best counts")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from engine import LLM, EngineConfig, SamplingParams
    from engine.model_runner import available_cpus
    from engine.models.model_names import resolve_model_arg

    model = resolve_model_arg(args.model)
    sizes = [int(s) for s in args.seqs.split(",")]
    llms = {head: LLM(EngineConfig(model=model, dtype="bfloat16", head_dtype=head, max_num_seqs=max(sizes),
                                   max_model_len=512, seed=0, num_threads=available_cpus()))
            for head in ("auto", "float32")}
    for llm in llms.values():  # timed once their weights are on 2 MB pages, as a long run serves
        collapser = getattr(llm.core.worker, "collapser", None)
        if collapser is not None:
            collapser.idle.wait(600)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=128, ignore_eos=True)
    rng = random.Random(0)
    for seqs in sizes:
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 129))]}
                   for _ in range(max(1, seqs // 8))]
        best = {}
        for llm in llms.values():
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm
        for _ in range(args.rounds):
            for head, llm in llms.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                rate = sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0)
                best[head] = max(best.get(head, 0.0), rate)
        log.info("%4d seqs: bf16 head %.1f tok/s, fp32 head %.1f tok/s: fp32 / bf16 %.3f", seqs, best["auto"],
                 best["float32"], best["float32"] / best["auto"])


if __name__ == "__main__":
    main()
