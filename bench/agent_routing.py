"""Multi-turn agent episodes over several sidecars, three ways of placing their turns, side by side in one
run (issue 66):

  static   the client without sessions, as a batch agent loop uses it: each wave of turns (every live
           episode's next one) is one `generate` call, cut into contiguous parts (rollout/client/spread.py);
           an episode moves whenever one before it in the wave has ended, and a wave waits for its longest
  least    one call a turn, no session: each call to the least busy sidecar (no affinity)
  hash     one call a turn, on sidecar crc32(episode) % N (consistent hashing: affinity, blind to load)
  ours     one call a turn, named as its session: `AsyncRolloutClient` places it
           (rollout/client/placement.py: sticky, the least busy for a new one, moved past a margin)

The workload, the same for all four (seeded: our engine samples a seeded request the same on any
sidecar in any batch): rounds of E episodes of 3-5 turns, the calculator environment's shape: a first
prompt of 512-768 tokens (`--first-tokens`; the calculator's is 581-587 with SmolLM2's tokenizer), then
each turn's prompt is the last one, its completion and an 8-24 token tool result; a turn's length is
drawn from 8-48 tokens (an answer ends where EOS would end it: EOS is ignored so that every policy
generates the same tokens). Before each policy's round the trainer pushes new weights to every sidecar
(the prefix caches are keyed by version: nothing carries over between policies or rounds). Each sidecar
is bound to one core (`taskset`), N over the machine's cores.

Prints per policy: episodes/s, p90 episode latency, prefix hits as a share of the reusable prompt tokens
(each turn's full blocks of the last turn's computed tokens: what a cache that kept everything would
serve), and the load spread, max / mean of each sidecar's forward time (its engine's busy seconds).
Goals (issue 66): ours >= 90% hits, >= 1.3x static's episodes/s, spread <= 1.2. Each policy's round
follows the others' of the same round (interleaved), so a slower minute of a shared machine falls on all.

    python -m bench.agent_routing                         # SmolLM2 if built, 4 sidecars
    python -m bench.agent_routing --first-tokens 96-192   # short first prompts
    python -m bench.agent_routing --quick                 # tiny model, 2 sidecars, one round
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import time
import zlib
from dataclasses import dataclass, field

log = logging.getLogger("bench.agent_routing")

POLICIES = ("static", "least", "hash", "ours")


@dataclass
class Episode:
    name: str
    first: list[int]  # its first prompt
    tools: list[list[int]]  # the tool result after each turn but the last
    lengths: list[int]  # each turn's completion length
    seed: int
    prompt: list[int] = field(default_factory=list)
    reusable: int = 0  # prompt tokens a cache that kept this episode's blocks would serve
    seconds: float = 0.0


def make_round(k: int, n: int, vocab: int, seed: int, first: tuple[int, int] = (96, 192)) -> list[Episode]:
    rng = random.Random(seed)
    out = []
    for j in range(n):
        turns = rng.randint(3, 5)
        out.append(Episode(f"r{k}-e{j}", [rng.randrange(100, vocab) for _ in range(rng.randint(*first))],
                           [[rng.randrange(100, vocab) for _ in range(rng.randint(8, 24))] for _ in range(turns - 1)],
                           [rng.randint(8, 48) for _ in range(turns)], seed=seed * 1000 + j))
    return out


def _turn_done(e: Episode, t: int, completion: list[int], block: int) -> bool:
    """The turn's completion in; the next turn's prompt built. False when the episode is over."""
    if t == len(e.tools):
        return False
    computed = len(e.prompt) + len(completion) - 1  # the last sampled token's KV is never written
    e.prompt = e.prompt + completion + e.tools[t]
    e.reusable += min(computed, len(e.prompt) - 1) // block * block
    return True


async def play_sessions(pick, episodes: list[Episode], params_of, block: int) -> None:
    """hash and ours: every episode plays on its own, one call a turn; `pick(e)` -> (client, sessions)."""
    async def one(e: Episode):
        t0, t = time.perf_counter(), 0
        e.prompt = list(e.first)
        client, sessions = pick(e)
        while True:
            (r,), = await client.generate([e.prompt], params_of(e, t), sessions=sessions)
            if not _turn_done(e, t, r.token_ids, block):
                break
            t += 1
        if sessions is not None:
            client.end_session(sessions)
        e.seconds = time.perf_counter() - t0

    await asyncio.gather(*(one(e) for e in episodes))


async def play_waves(client, episodes: list[Episode], params_of, block: int) -> None:
    """static: every live episode's next turn in one call, a wave at a time."""
    t0 = time.perf_counter()
    live = {e.name: 0 for e in episodes}
    by_name = {e.name: e for e in episodes}
    for e in episodes:
        e.prompt = list(e.first)
    while live:
        names = list(live)
        groups = await client.generate([by_name[n].prompt for n in names], [params_of(by_name[n], live[n])
                                                                             for n in names])
        for n, (r,) in zip(names, groups):
            if _turn_done(by_name[n], live[n], r.token_ids, block):
                live[n] += 1
            else:
                by_name[n].seconds = time.perf_counter() - t0
                del live[n]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.agent_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: SmolLM2's if built, else the tiny model)")
    p.add_argument("--sidecars", type=int, default=4)
    p.add_argument("--episodes", type=int, default=32, help="episodes per round, all in flight at once")
    p.add_argument("--rounds", type=int, default=3, help="rounds per policy, a push before each")
    p.add_argument("--first-tokens", default="512-768", metavar="LO-HI",
                   help="an episode's first prompt length, drawn from LO-HI (default: around the calculator's, "
                   "581-587 tokens with SmolLM2's tokenizer and three worked examples; 96-192: a short one)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 2 sidecars, 8 episodes of short first prompts, one round")
    args = p.parse_args(argv)
    args.first = tuple(int(x) for x in args.first_tokens.split("-"))
    if args.quick:
        args.sidecars, args.episodes, args.rounds, args.model = 2, 8, 1, args.model or "tiny"
        args.first = (96, 192)
    return args


def _model_dir(choice: str | None) -> str:
    from rollout.sidecar.serve_args import model_dir_or_exit

    if choice is None:
        smol = os.path.expanduser("~/.cache/rollout-sidecar/smollm2")
        choice = smol if os.path.isdir(smol) else None
    return model_dir_or_exit(choice)


async def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine import SamplingParams
    from engine.config import EngineConfig
    from recipes.rollout_source import LocalSidecars
    from rollout import AsyncRolloutClient

    model_dir = _model_dir(args.model)
    block = EngineConfig.block_size
    cores = os.sched_getaffinity(0)
    token = "bench"
    flags = ["--max-model-len", str(max(1024, args.first[1] + 5 * (48 + 24) + 16)), "--log-level", "WARNING",
             "--stats-interval", "0", "--warm-standby", "off", "--dtype", args.dtype, "--max-num-seqs", "64"]
    sidecars = LocalSidecars(model_dir, args.sidecars, flags, token,
                             prefixes=[["taskset", "-c", str(sorted(cores)[k % len(cores)])]
                                       for k in range(args.sidecars)])
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = min(trainer.config.vocab_size, 40000)
    pusher = AsyncRolloutClient(sidecars.urls, token=token)
    ours = AsyncRolloutClient(sidecars.urls, token=token)
    static = AsyncRolloutClient(sidecars.urls, token=token)
    singles = [AsyncRolloutClient(u, token=token) for u in sidecars.urls]
    version = 0

    def params_of(e: Episode, t: int):
        return SamplingParams(n=1, temperature=1.0, max_tokens=e.lengths[t], ignore_eos=True, seed=e.seed + t)

    out = {p: {"episodes": [], "seconds": 0.0, "hits": 0, "reusable": 0, "busy": [0.0] * args.sidecars}
           for p in args.policies.split(",")}
    try:
        await pusher.init_weight_sync()
        for k in range(args.rounds):
            for policy in out:
                version += 1
                with torch.no_grad():
                    trainer.lm_head.weight.add_(1e-4)  # new weights, the same tokens' likelihoods nearly
                await pusher.push_weights(trainer, version)
                episodes = make_round(k, args.episodes, vocab, seed=k + 1, first=args.first)
                before = await pusher.load()
                t0 = time.perf_counter()
                if policy == "static":
                    await play_waves(static, episodes, params_of, block)
                elif policy == "least":
                    await play_sessions(lambda e: (static, None), episodes, params_of, block)
                elif policy == "hash":
                    await play_sessions(lambda e: (singles[zlib.crc32(e.name.encode()) % len(singles)], None),
                                        episodes, params_of, block)
                else:
                    await play_sessions(lambda e: (ours, e.name), episodes, params_of, block)
                wall = time.perf_counter() - t0
                after = await pusher.load()
                o = out[policy]
                o["seconds"] += wall
                o["episodes"] += episodes
                o["hits"] += sum(a["prefix_hit_tokens"] - b["prefix_hit_tokens"] for a, b in zip(after, before))
                o["reusable"] += sum(e.reusable for e in episodes)
                for i, (a, b) in enumerate(zip(after, before)):
                    o["busy"][i] += a["forward_s"] - b["forward_s"]
                log.info("round %d %s: %.1f s", k, policy, wall)
        out["ours"]["placement"] = ours.placement_stats() if "ours" in out else None
    finally:
        for c in [pusher, ours, static, *singles]:
            await c.close()
        sidecars.stop()
    return out


def report(out: dict, args) -> None:
    rows = []
    for policy, o in out.items():
        eps = len(o["episodes"]) / o["seconds"]
        p90 = statistics.quantiles([e.seconds for e in o["episodes"]], n=10)[-1]
        mean_busy = sum(o["busy"]) / len(o["busy"])
        spread = max(o["busy"]) / mean_busy if mean_busy else 0.0
        rows.append((policy, eps, p90, o["hits"] / max(o["reusable"], 1), spread))
    base = dict((r[0], r[1]) for r in rows).get("static")
    print(f"\n{args.sidecars} sidecars (one core each, {len(os.sched_getaffinity(0))} cores), {args.rounds} rounds x "
          f"{args.episodes} episodes of 3-5 turns, first prompts of {args.first_tokens} tokens, 8-48 tokens a turn, "
          f"{args.dtype}, a push before each")
    print(f"{'policy':8} {'episodes/s':>10} {'x static':>9} {'p90 s':>7} {'hits/reusable':>14} {'busy max/mean':>14}")
    for policy, eps, p90, hits, spread in rows:
        ratio = f"{eps / base:.2f}" if base else "-"
        print(f"{policy:8} {eps:10.2f} {ratio:>9} {p90:7.1f} {hits:14.1%} {spread:14.2f}")
    if out.get("ours", {}).get("placement"):
        p = out["ours"]["placement"]
        print(f"ours: {p['sessions']} sessions, {p['moves']} moves")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # N sidecars over fewer cores: no spinning barriers
    report(asyncio.run(run(args)), args)


if __name__ == "__main__":
    main()
