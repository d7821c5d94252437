"""`python -m recipes.agent`: GRPO over whole multi-turn episodes on the rollout sidecar (see `--help`).

Each step plays `--prompts-per-step` x `--group-size` episodes at once (a group: one environment
seed), each turn a request to the sidecar, through `AsyncRolloutClient` (`--transport client`) or
the sidecar's OpenAI front with the official `openai` client (`--transport openai`); the update
(recipes/policy_update.py) trains on the policy's own tokens only, with the engine's logprobs per
token for the truncated importance weights; then the weights are pushed. With `--async` the next
step's episodes play while this step trains, so pushes land mid-episode (in the sidecar's pause
mode, keep by default) and `--max-staleness` bounds how old an episode's first token may be.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from recipes import prefix_metrics as PM
from recipes import routing_metrics as RM
from recipes.algorithms import GRPO
from recipes.episode_metrics import episode_metrics, episode_rewards, transcript_rows
from recipes.episodes import Settings, run_episodes
from recipes.flags import build_parser
from recipes.policy_update import update
from recipes.rl_train import close, finish, push, push_metrics, setup
from recipes.seeds import request_seed

log = logging.getLogger("recipes")

# the embedded tiny model on the letter game (learns from scratch); a pretrained chat model with a tool
DEFAULTS = {
    "letters": {"max_steps": 40, "prompts_per_step": 8, "group_size": 8, "max_tokens": 16, "temperature": 1.0,
                "lr": 2e-3, "max_turns": 3, "tool_call_parser": None, "model": None},
    # a call is ~30 tokens, an answer ~8: 3 turns of 64 fit beside the worked examples (~580) in 1024.
    # Temperature 1: at 0.7 the examples leave SmolLM2 nearly greedy (entropy 0.002-0.02), whole groups
    # alike, and GRPO without signal (README "Agents"). Episodes of ~700 tokens: with 16 a step,
    # --minibatches 4 keeps the update's activations near 4 GiB
    "calculator": {"max_steps": 18, "prompts_per_step": 4, "group_size": 4, "max_tokens": 64, "temperature": 1.0,
                   "lr": 1e-5, "max_turns": 3, "tool_call_parser": "hermes", "model": "smollm2"},
}


def build_agent_parser():
    from recipes.envs import ENVIRONMENTS

    p = build_parser("grpo", prog="python -m recipes.agent", tasks=False, description=(
        "GRPO over multi-turn episodes on the rollout sidecar. With no flags: builds the embedded tiny model, "
        "starts its own sidecar and trains on the letter game (3 turns, feedback each turn) on CPU."))
    g = p.add_argument_group("episodes")
    g.add_argument("--env", default="letters", choices=ENVIRONMENTS,
                   help="letters: the tiny model's game; calculator: arithmetic with a calculator tool (SmolLM2)")
    g.add_argument("--transport", default="client", choices=["client", "openai"],
                   help="client: AsyncRolloutClient (ZMQ); openai: the sidecar's OpenAI front (--http-port) with "
                        "the openai client")
    g.add_argument("--max-turns", type=int, default=None, help="assistant turns per episode at most (default: 3)")
    g.add_argument("--examples", type=int, default=3, choices=range(4), metavar="0-3",
                   help="worked exchanges (question, call, reply, answer) the calculator shows before its question: "
                        "SmolLM2-135M calls the tool under three, hardly under one")
    g.add_argument("--letters", default="a", help="letters the letter game asks for (one drawn per episode)")
    g.add_argument("--max-staleness", type=int, default=None,
                   help="play an episode again from its start when its first token is more than this many versions "
                        "behind the newest push as a turn starts (with --async)")
    g.add_argument("--tool-call-parser", default="default", help="read tool calls out of the text with this parser "
                   "(rollout.tool_calls; hermes for calculator, none for letters by default)")
    g.add_argument("--chat-template", default="auto", metavar="auto|model|FILE_OR_TEXT",
                   help="the chat template of the episodes' prompts, on both transports (the sidecar gets it as "
                        "--chat-template). auto: with a tool-call parser, rollout.tool_calls' Hermes ChatML template "
                        "when the model's own renders no tools (the tiny model's, SmolLM2's), else the model's; "
                        "model: the model's own")
    g.add_argument("--http-url", default=None, help="with --rollout-url and --transport openai: the front's URL (a "
                   "router's: add --routed)")
    g.add_argument("--routed", action="store_true", help="--http-url is a router's (python -m rollout.router): each "
                   "episode's turns name their session (X-Session-ID) and end it (/finish_session)")
    g.add_argument("--max-context", type=int, default=1024, help="no turn starts that could not fit this (the sidecar's "
                   "--max-model-len)")
    return p


def parse_args(argv=None):
    args = build_agent_parser().parse_args(argv)
    for name, value in DEFAULTS[args.env].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.tool_call_parser in ("default", "none"):
        args.tool_call_parser = DEFAULTS[args.env]["tool_call_parser"] if args.tool_call_parser == "default" else None
    if args.ray or args.async_ and args.minibatches > 1:
        raise SystemExit("error: recipes.agent runs local sidecars (no --ray), and --async with one minibatch")
    args.task = f"agent-{args.env}"  # names the run
    args.sidecar_args = []
    args.chat_template_text = args.chat_template_source = None  # resolved with the tokenizer (_env_factory)
    if args.transport == "openai":
        args.sidecar_args = ["--http-port", "0"]
        if args.tool_call_parser:
            args.sidecar_args += ["--tool-call-parser", args.tool_call_parser, "--enable-auto-tool-choice"]
    return args


def _env_factory(args, tokenizer):
    """The run's environments; first the chat template (setup calls this before it starts the sidecar,
    which is given the same template)."""
    from recipes.envs import env_factory
    from recipes.turns import takes_tools

    args.chat_template_text = _chat_template(args, tokenizer)
    if args.chat_template_text is not None and args.transport == "openai":
        args.sidecar_args += ["--chat-template", args.chat_template_source]
    renders_tools = takes_tools(args.chat_template_text or tokenizer.chat_template)

    def make(examples: int):
        return env_factory(args.env, tokenizer, turns=args.max_turns, letters=args.letters,
                           tools_in_prompt=not renders_tools, examples=examples)

    return make(_examples_that_fit(args, tokenizer, make) if args.env == "calculator" else args.examples)


def _examples_that_fit(args, tokenizer, make) -> int:
    """The most worked exchanges, up to --examples, whose first prompt leaves room for --max-turns
    turns of --max-tokens in --max-context (a model whose tokenizer spends many tokens on them, such
    as the embedded tiny model's, gets fewer)."""
    from recipes.turns import ClientTurns

    turns = ClientTurns(None, tokenizer, None, args.chat_template_text)

    def fits(k: int) -> bool:
        first = make(k)().reset(0)
        return len(turns.prompt_ids(first.messages, first.tools)) + args.max_turns * args.max_tokens <= args.max_context

    k = next((k for k in range(args.examples, 0, -1) if fits(k)), 0)
    if k < args.examples:
        log.warning("--examples %d: the first prompt would leave no room for the turns in --max-context %d; showing %d",
                    args.examples, args.max_context, k)
    return k


def _chat_template(args, tokenizer) -> str | None:
    """--chat-template's text, or None for the tokenizer's own (its source in args.chat_template_source)."""
    from recipes.turns import takes_tools
    from rollout.sidecar.serve_checks import chat_template_text
    from rollout.tool_calls import HERMES_CHAT_TEMPLATE

    choice = args.chat_template
    if choice == "model" or choice == "auto" and (not args.tool_call_parser or takes_tools(tokenizer.chat_template)):
        return None
    args.chat_template_source = str(HERMES_CHAT_TEMPLATE) if choice == "auto" else choice
    try:
        return chat_template_text(args.chat_template_source)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def turn_source(run):
    """The episodes' event-loop thread and its source of turns (recipes/turns.py)."""
    from recipes.turns import client_turns, openai_turns

    args = run.args
    if args.transport == "openai":
        fronts = run.sidecar.http_urls if run.sidecar is not None else []
        if args.http_url is None and len(fronts) > 1:  # several sidecars: a router keeps each episode on one
            from rollout.launcher import LocalRouter

            run.router = LocalRouter(fronts, "--log-level", "WARNING", token=args.token)
            log.info("router over %d sidecars: %s", len(fronts), run.router.url)
            return openai_turns(run.router.url, args.token, routed=True)
        url = args.http_url or (fronts[0] if fronts else None)
        if url is None:
            raise SystemExit("error: --transport openai with --rollout-url needs --http-url")
        return openai_turns(url, args.token, routed=args.routed)
    parser = None
    if args.tool_call_parser:
        from rollout.tool_calls import get_tool_parser

        parser = get_tool_parser(args.tool_call_parser)
    return client_turns(run.client.urls, args.token, run.tokenizer, parser, args.chat_template_text)


def _env_seed(run_seed: int, call: int, group: int) -> int:
    return int.from_bytes(hashlib.sha256(f"env:{run_seed}:{call}:{group}".encode()).digest()[:4], "big")


class Episodes:
    """Each step's episodes, played on the turn thread; with --async the next step's play meanwhile."""

    def __init__(self, run, thread):
        self.run, self.thread, self.calls, self.pending = run, thread, 0, None
        a = run.args
        self.settings = Settings(a.max_turns, a.max_tokens, a.temperature, a.max_context, a.max_staleness,
                                 newest_version=lambda: run.version)

    def _submit(self):
        a, call = self.run.args, self.calls
        self.calls += 1
        n = a.prompts_per_step * a.group_size
        seeds = [_env_seed(a.seed, call, i // a.group_size) for i in range(n)]
        request_seeds = [request_seed(a.seed, call, i) for i in range(n)]
        t0 = time.perf_counter()
        future = self.thread.submit(run_episodes, self.run.task, seeds, request_seeds, self.settings)
        return future, t0

    def next(self, more: bool) -> tuple[list, float]:
        future, t0 = self.pending or self._submit()
        self.pending = self._submit() if self.run.args.async_ and more else None
        episodes = future.result()
        return episodes, time.perf_counter() - t0


def agent_step(run, episodes_source: Episodes, step: int) -> dict:
    """Episodes -> rewards -> update -> push; logs and returns the step's metrics."""
    t_step = time.perf_counter()
    episodes, t_gen = episodes_source.next(step + 1 < run.args.max_steps)
    if not any(e.trainable for e in episodes):  # some may fail (logged, counted); all: something is wrong
        raise RuntimeError(f"step {step + 1}: none of its {len(episodes)} episodes can train; the first error: "
                           f"{next((e.error for e in episodes if e.error), 'none')}")
    pad = run.tokenizer.pad_token_id or 0
    for e in episodes:
        if not e.prompt_token_ids:  # its environment raised in reset: one token to stand on, nothing trained
            e.prompt_token_ids = [pad]
    rewards = episode_rewards(episodes, run.args.group_size)
    t_train = time.perf_counter()
    metrics = update(run, episodes, rewards)
    t_train = time.perf_counter() - t_train
    run.version += 1
    t_sync = push(run)
    starts = [e.start_version for e in episodes if e.start_version is not None]
    metrics.update({
        "reward": rewards.mean().item(), "reward_std": rewards.std().item(), **episode_metrics(episodes),
        "timing/generate": t_gen, "timing/train": t_train, "timing/weight_sync": t_sync,
        "timing/step": time.perf_counter() - t_step, "episodes/per_second": len(episodes) / max(t_gen, 1e-9),
        "staleness": run.version - 1 - min(starts) if starts else 0, "weight_version": run.version,
        **push_metrics(run.pushed),
        **_prefix_cache(run),
        **_routing(run, episodes_source.thread),
    })
    run.tracker.log(step + 1, metrics)
    run.tracker.log_completions(step + 1, transcript_rows(episodes, rewards, run.args.log_completions,
                                                          run.args.group_size))
    return metrics


def _prefix_cache(run) -> dict:
    """The sidecars' prefix caches over the step (recipes/prefix_metrics.py): multi-turn episodes
    reuse each turn's prefix, within a version."""
    if run.client is None:
        return {}
    now = PM.totals(run.client.health())
    metrics, run.prefix_seen = PM.step_metrics(now, run.prefix_seen), now
    return metrics


def _routing(run, thread) -> dict:
    """routing/* over the step when episodes run over several sidecars (recipes/routing_metrics.py)."""
    if run.client is None or len(run.client.urls) < 2:
        return {}
    now = RM.sidecar_counters(run.client)
    metrics = RM.step_metrics(now, run.routing_seen, _placement(run, thread))
    run.routing_seen = now
    return metrics


def _placement(run, thread) -> dict | None:
    """The sessions' placement: the router's, or the turn thread's client's."""
    if run.router is not None:
        import httpx

        return httpx.get(run.router.url + "/health", timeout=30).json()
    turns = thread.turns
    if hasattr(turns, "client") and hasattr(turns.client, "placement_stats"):
        return thread.submit(_stats_of).result(30)
    return None


async def _stats_of(turns) -> dict:
    return turns.client.placement_stats()


def _first_and_last(rows: list[dict], names) -> dict:
    """first_NAME / last_NAME: the mean over the first and the last 10 steps (fewer in a short run),
    as recipes.rl_train.finish gives the reward's; for the names the run logged."""
    k = max(1, min(10, len(rows) // 2))
    out = {}
    for name in names:
        if any(name in r for r in rows):
            short = name.split("/")[-1]
            out[f"first_{short}"] = sum(r.get(name, 0.0) for r in rows[:k]) / k
            out[f"last_{short}"] = sum(r.get(name, 0.0) for r in rows[-k:]) / k
            log.info("%s: first %d steps %.3f -> last %d steps %.3f", name, k, out[f"first_{short}"], k,
                     out[f"last_{short}"])
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = setup(GRPO(args), args, make_task=_env_factory)
    thread = None
    try:
        if run.accelerator.num_processes > 1:
            raise SystemExit("error: recipes.agent trains on one process")
        thread = turn_source(run)
        source = Episodes(run, thread)
        push(run)
        bar = tqdm(range(args.max_steps), desc="agent", unit="step")
        with logging_redirect_tqdm():
            for step in bar:
                m = agent_step(run, source, step)
                bar.set_postfix(reward=f"{m['reward']:.3f}", turns=f"{m['episodes/turns']:.1f}",
                                failed=m["episodes/errors"])
        out = finish(run)
        out.update(_first_and_last(run.tracker.rows, ("env/correct", "episodes/called_well")))
        log.info("episodes: %s", Path(args.output_dir) / "completions.jsonl")
        return out
    finally:
        if thread is not None:
            thread.close()
        close(run)


if __name__ == "__main__":
    main()
