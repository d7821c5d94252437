"""How often an untrained model calls the calculator well: the starting point of `recipes.agent --env
calculator`.

Plays `--episodes` calculator episodes (recipes/envs/calculator.py) at `--temperature` against a
sidecar it starts as the recipe does (the Hermes ChatML template, the hermes tool-call parser, turns
through `AsyncRolloutClient`) under `--examples` worked exchanges, and prints per setting: the share
of episodes with a well-formed call (it ran), with a malformed one, and answered right; turns per
episode. `-v` logs a few transcripts. No weights change: this is the untrained model.

    python -m bench.agent_calculator_probe                       # SmolLM2-135M-Instruct, 32 episodes
    python -m bench.agent_calculator_probe --model tiny --episodes 8
"""

from __future__ import annotations

import argparse
import logging
import statistics

log = logging.getLogger("bench.agent_calculator_probe")


def probe(thread, examples: int, episodes: int, settings, seed: int) -> dict:
    """One setting's episodes -> the shares the module's docstring names."""
    from recipes.envs import Calculator
    from recipes.episodes import run_episodes

    played = thread.submit(run_episodes, lambda: Calculator(tools_in_prompt=False, examples=examples),
                           [seed + i for i in range(episodes)], [seed + 7 * i for i in range(episodes)],
                           settings).result()
    for e in played[:3]:
        log.debug("examples=%d T=%.2f reward %.1f: %s", examples, settings.temperature, e.reward,
                  [(m["role"], m.get("content")) for m in e.messages[-4:]])
    return {"examples": examples, "temperature": settings.temperature,
            "well_formed": sum(e.tool_calls > e.tool_errors for e in played) / episodes,
            "malformed": sum(e.tool_errors > 0 for e in played) / episodes,
            "correct": sum(e.metrics.get("correct", 0.0) for e in played) / episodes,
            "turns": statistics.mean(e.turns for e in played),
            "errors": sum(e.error is not None for e in played)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.agent_calculator_probe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model name (smollm2, tiny, ...) or directory")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--temperature", default="1.0", help="comma-separated settings")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--examples", default="0,1,3", help="worked exchanges shown, comma-separated settings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from transformers import AutoTokenizer

    from recipes.episodes import Settings
    from recipes.turns import client_turns
    from rollout.launcher import LocalSidecar
    from rollout.sidecar.serve_args import model_dir_or_exit
    from rollout.tool_calls import HERMES_CHAT_TEMPLATE, get_tool_parser

    model = model_dir_or_exit(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    sidecar = LocalSidecar(model, "--max-model-len", "1024", "--max-num-seqs", str(args.episodes),
                           "--log-level", "WARNING", "--stats-interval", "0")
    thread = client_turns(sidecar.url, "", tokenizer, get_tool_parser("hermes"), HERMES_CHAT_TEMPLATE.read_text())
    try:
        rows = [probe(thread, int(k), args.episodes, Settings(max_turns=args.max_turns, max_tokens=args.max_tokens,
                                                              temperature=float(t), max_context=1024), args.seed)
                for t in args.temperature.split(",") for k in args.examples.split(",")]
    finally:
        thread.close()
        sidecar.stop()
    print(f"\n{'T':>4} {'examples':>8} {'well-formed':>11} {'malformed':>9} {'correct':>7} {'turns':>5} {'errors':>6}")
    for r in rows:
        print(f"{r['temperature']:>4.2f} {r['examples']:>8} {r['well_formed']:>11.2f} {r['malformed']:>9.2f} "
              f"{r['correct']:>7.2f} {r['turns']:>5.2f} {r['errors']:>6}")


if __name__ == "__main__":
    main()
