"""Offline generation demo on the embedded tiny model: builds it (offline, cached), runs the
engine on a GRPO-shaped batch (groups of n samples), and logs throughput and prefix-cache hits."""

from __future__ import annotations

import argparse
import logging
import time

log = logging.getLogger("recipes.demo")


def main(argv: list[str] | None = None) -> None:
    from engine.models.model_names import MODEL_HELP
    from engine.models.tiny_model import SIZES

    p = argparse.ArgumentParser(description="Generate with the rollout engine on the tiny offline model (CPU).")
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: the embedded model of --size)")
    p.add_argument("--size", default="tiny", choices=list(SIZES),
                   help="size of the embedded model when --model is not given")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--num-prompts", type=int, default=8, help="number of prompts")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (a GRPO group)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from engine import LLM, EngineConfig, SamplingParams
    from engine.models.model_names import resolve_model_arg

    model = resolve_model_arg(args.model or args.size)
    llm = LLM(EngineConfig(model=model, device=args.device, max_num_seqs=64, max_model_len=512, seed=0))
    prompts = [f"Q: what is {i} + {i * 3}? A:" for i in range(args.num_prompts)]
    params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=1)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for o in outs[:3]:
        for c in o.outputs[:2]:
            log.info("%r -> %r (%s, mean logprob %.2f)", o.prompt, c.text, c.finish_reason,
                     c.cumulative_logprob / max(1, len(c.token_ids)))
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    stats = llm.core.stats()
    log.info("%d sequences, %d tokens in %.2fs: %.0f tokens/s; prefix cache served %d of %d prompt tokens",
             sum(len(o.outputs) for o in outs), tokens, dt, tokens / dt,
             stats["prefix_cache_hit_tokens"], stats["prefix_cache_query_tokens"])


if __name__ == "__main__":
    main()
