"""Multi-turn episodes against one sidecar, against the same tokens generated as single-turn requests.

The workload: K letter-game episodes (recipes/envs/letters.py) of `--turns` turns of at most
`--max-tokens` tokens each, all in flight at once, played by recipes/episodes.py through

  client   `AsyncRolloutClient` (ZMQ; each turn's prompt built by the chat template here);
  openai   the sidecar's OpenAI front with `openai.AsyncOpenAI` (what an agent framework uses);

and, as the anchor, `single`: one request per episode from its first prompt, asking for exactly the
tokens the episode's turns generated (EOS ignored), all in one `RolloutClient.generate` call. Each
turn after the first re-sends the conversation; the prefix cache spares most of it. Prints
episodes/s and generated tokens/s for each, episodes' tokens/s over single-turn's, and openai over
client.

    python -m bench.agent_episodes                       # tiny model, K = 64 and 256
    python -m bench.agent_episodes --model small --in-flight 64
"""

from __future__ import annotations

import argparse
import logging
import time

log = logging.getLogger("bench.agent_episodes")


def play(thread, tokenizer, k: int, turns: int, max_tokens: int, seed: int) -> tuple[list, float]:
    from recipes.envs import env_factory
    from recipes.episodes import Settings, run_episodes

    settings = Settings(max_turns=turns, max_tokens=max_tokens, temperature=1.0, max_context=1024)
    make = env_factory("letters", tokenizer, turns=turns)
    t0 = time.perf_counter()
    episodes = thread.submit(run_episodes, make, [seed + i for i in range(k)],
                             [1000 * seed + i for i in range(k)], settings).result()
    wall = time.perf_counter() - t0
    if any(e.error for e in episodes):
        raise RuntimeError(f"an episode failed: {next(e.error for e in episodes if e.error)}")
    return episodes, wall


def single_turn(client, episodes: list) -> float:
    """The episodes' tokens again, each episode's as one request from its first prompt."""
    from engine import SamplingParams

    params = [SamplingParams(n=1, temperature=1.0, max_tokens=sum(e.policy_mask), ignore_eos=True, seed=i)
              for i, e in enumerate(episodes)]
    t0 = time.perf_counter()
    groups = client.generate([e.prompt_token_ids for e in episodes], params)
    wall = time.perf_counter() - t0
    assert sum(len(g[0].token_ids) for g in groups) == sum(sum(e.policy_mask) for e in episodes)
    return wall


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.agent_episodes", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny", help="an embedded size or a model directory")
    p.add_argument("--in-flight", default="64,256", help="episodes in flight at once, comma-separated")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens a turn at most")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for quiet in ("httpx", "httpx2", "openai"):  # a line per request otherwise
        logging.getLogger(quiet).setLevel(logging.WARNING)

    from transformers import AutoTokenizer

    from engine.models.model_names import resolve_model_arg
    from recipes.turns import client_turns, openai_turns
    from rollout import RolloutClient
    from rollout.launcher import LocalSidecar

    model = resolve_model_arg(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    sizes = [int(k) for k in args.in_flight.split(",")]
    sidecar = LocalSidecar(model, "--http-port", "0", "--max-num-seqs", str(max(sizes)), "--max-model-len", "1024",
                           "--log-level", "WARNING", "--stats-interval", "0")
    client = RolloutClient(sidecar.url)
    threads = {"client": client_turns(sidecar.url, "", tokenizer), "openai": openai_turns(sidecar.http_url, "")}
    rows = []
    try:
        play(threads["client"], tokenizer, 8, args.turns, args.max_tokens, seed=999)  # warm-up
        for k in sizes:
            for path, thread in threads.items():
                episodes, wall = play(thread, tokenizer, k, args.turns, args.max_tokens, seed=k)
                tokens = sum(sum(e.policy_mask) for e in episodes)
                single = single_turn(client, episodes)
                rows.append((k, path, k / wall, tokens / wall, tokens / single))
                log.info("%d in flight, %s: %.2f episodes/s, %.0f tok/s; the same tokens single-turn %.0f tok/s",
                         k, path, k / wall, tokens / wall, tokens / single)
    finally:
        for t in threads.values():
            t.close()
        client.close()
        sidecar.stop()
    print(f"\n{'in flight':>9} {'path':>7} {'episodes/s':>11} {'tok/s':>8} {'single tok/s':>13} {'ep/single':>10}")
    for k, path, eps, tps, single in rows:
        print(f"{k:>9} {path:>7} {eps:>11.2f} {tps:>8.0f} {single:>13.0f} {tps / single:>10.2f}")
    by = {(k, path): tps for k, path, _, tps, _ in rows}
    for k in sizes:
        print(f"{k} in flight: openai / client tokens/s = {by[(k, 'openai')] / by[(k, 'client')]:.2f}")


if __name__ == "__main__":
    main()
