"""What a sidecar keeps for work nobody will collect (issue 26 item 3), measured as the resident
memory (VmRSS, from /proc) of the sidecar's processes:

- pushes: trainer processes SIGKILLed mid-push, one after another. Each given-up push held a
  staging copy of the weights in the engine core; the core's growth is reported in MB and in
  staging copies (the pushed bytes), then a last push from this process must land (checksums).
- clients: client processes SIGKILLed with generate calls in flight. The sidecar process and its
  engine cores are measured `--settle` seconds after the last kill, with the groups and sequences
  still in flight for the vanished clients.

    python -m bench.leaks                                   # tiny model, both scenarios
    python -m bench.leaks --model smollm2                   # SmolLM2-135M (needs the 'real' extra)
    python -m bench.leaks --model smollm2 --scenario clients --clients 200

The baseline of `pushes` is the steady state after two pushes (the weights plus the staging buffer
kept for the next push); that of `clients` follows a generate of the same shape by a live client.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("bench.leaks")

# A trainer that pushes the weights of a model directory (x1.5) to the sidecar named on stdin,
# and stops dead at bucket 3: the bench SIGKILLs it there.
TRAINER = r"""
import json, sys, time
from safetensors.torch import load_file
from rollout import RolloutClient
token, weights = sys.argv[1:3]
named = [(n, t * 1.5) for n, t in load_file(weights).items()]
client = RolloutClient(sys.stdin.readline().strip(), token=token)
client.init_weight_sync(bucket_bytes=1 << 20, take_over=True)
def stop_dead(k, n):
    if k == 3:
        print(json.dumps({"at": k}), flush=True)
        time.sleep(3600)
client.push_weights(named, version=7, progress=stop_dead)
"""

# K clients in one process, each with a generate call in flight; says "sent" and waits to be killed.
CLIENTS = r"""
import asyncio, random, sys
from engine.sampling_params import SamplingParams
from rollout.client import AsyncRolloutClient
url, token, k, prompts, prompt_len, n, max_tokens, vocab = sys.argv[1:9]
k, prompts, prompt_len, vocab = int(k), int(prompts), int(prompt_len), int(vocab)
async def main():
    rng = random.Random()
    params = SamplingParams(n=int(n), temperature=1.0, max_tokens=int(max_tokens), ignore_eos=True)
    clients = [AsyncRolloutClient(url, token=token) for _ in range(k)]
    calls = [asyncio.ensure_future(c.generate([[rng.randrange(vocab) for _ in range(prompt_len)]
                                               for _ in range(prompts)], params)) for c in clients]
    await asyncio.sleep(1.0)  # every call is with the sidecar
    print("sent", flush=True)
    await asyncio.gather(*calls)
asyncio.run(main())
"""

TOKEN = "bench-leaks"


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def core_pids(client) -> list[int]:
    return [s["pid"] for s in client.health()["engine_states"]]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}


def _start(model_dir: str, *extra: str):
    from rollout import RolloutClient
    from rollout.launcher import LocalSidecar

    sidecar = LocalSidecar(model_dir, "--log-level", "WARNING", "--stats-interval", "0", *extra, token=TOKEN)
    return sidecar, RolloutClient(sidecar.url, token=TOKEN, timeout_s=600)


def _kill_mid_push(trainer: subprocess.Popen, sidecar, client) -> None:
    failed = client.stats()["failed_pushes"]
    trainer.stdin.write(sidecar.url + "\n")
    trainer.stdin.flush()
    if trainer.stdout.readline().strip() != '{"at": 3}':
        raise RuntimeError("the trainer did not reach bucket 3")
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 60
    while client.stats()["failed_pushes"] == failed:
        if time.monotonic() > deadline:
            raise RuntimeError("the push of a dead trainer was never given up")
        time.sleep(0.1)


def killed_pushes(model_dir: str, trainers: int) -> dict:
    """Engine-core RSS in the steady state, after `trainers` pushes killed mid-transfer, and after
    one more push that lands."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    staging = sum(t.numel() * t.element_size() for t in weights.values())
    procs = [subprocess.Popen([sys.executable, "-c", TRAINER, TOKEN, os.path.join(model_dir, "model.safetensors")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
             for _ in range(trainers)]
    sidecar = client = None
    try:
        sidecar, client = _start(model_dir)
        client.init_weight_sync()
        for v in (1, 2):
            client.push_weights([(n, t + v) for n, t in weights.items()], version=v)
        start = sum(map(rss, core_pids(client)))
        for i, trainer in enumerate(procs):
            _kill_mid_push(trainer, sidecar, client)
            log.info("trainer %d killed mid-push: engine cores %+.1f MB", i + 1,
                     (sum(map(rss, core_pids(client))) - start) / 1e6)
        killed = sum(map(rss, core_pids(client)))
        new = [(n, t * 0.5) for n, t in weights.items()]
        client.init_weight_sync()
        client.push_weights(new, version=8)
        landed = client.weights_checksums() == [client.checksum_of(new)]
        return {"staging": staging, "start": start, "killed": killed,
                "pushed": sum(map(rss, core_pids(client))), "landed": landed}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        if client is not None:
            client.close()
        if sidecar is not None:
            sidecar.stop()


def _sidecar_rss(sidecar, client) -> tuple[int, int]:
    return rss(sidecar.proc.pid), sum(map(rss, core_pids(client)))


def vanished_clients(model_dir: str, args) -> dict:
    """RSS of the sidecar and its cores before and `args.settle` s after `args.clients` clients
    vanish mid-generate, with the work still in flight for them."""
    from engine.sampling_params import SamplingParams

    sidecar, client = _start(model_dir, "--max-model-len", str(args.prompt_len + args.max_tokens))
    try:
        vocab = _vocab(model_dir)
        warm = SamplingParams(n=args.n, temperature=1.0, max_tokens=8, ignore_eos=True)  # a batch of that shape
        client.generate([[5 + i] * args.prompt_len for i in range(args.prompts * args.per_process)], warm)
        before = _sidecar_rss(sidecar, client)
        for done in range(0, args.clients, args.per_process):
            k = min(args.per_process, args.clients - done)
            p = subprocess.Popen([sys.executable, "-c", CLIENTS, sidecar.url, TOKEN, str(k), str(args.prompts),
                                  str(args.prompt_len), str(args.n), str(args.max_tokens), str(vocab)],
                                 stdout=subprocess.PIPE, text=True, env=_env())
            if p.stdout.readline().strip() != "sent":
                raise RuntimeError("a client process failed")
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        log.info("%d clients vanished; waiting %.0f s", args.clients, args.settle)
        time.sleep(args.settle)
        stats = client.stats()
        return {"before": before, "after": _sidecar_rss(sidecar, client), "groups": stats["groups_in_flight"],
                "sequences": stats["queue_depth"]}
    finally:
        client.close()
        sidecar.stop()


def _vocab(model_dir: str) -> int:
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def report(args, pushes: dict | None, clients: dict | None) -> None:
    rows = [("scenario", "measure", "value")]
    if pushes:
        def grown(b: int) -> str:
            return f"{(b - pushes['start']) / 1e6:+.1f} MB ({(b - pushes['start']) / pushes['staging']:+.2f} copies)"

        rows += [("pushes", "staging copy (pushed bytes)", f"{pushes['staging'] / 1e6:.1f} MB"),
                 ("pushes", f"engine cores after {args.trainers} killed pushes", grown(pushes["killed"])),
                 ("pushes", "engine cores after the next push", grown(pushes["pushed"])),
                 ("pushes", "next push landed (checksums equal)", str(pushes["landed"]))]
    if clients:
        (s0, c0), (s1, c1) = clients["before"], clients["after"]
        rows += [("clients", f"sidecar process {args.settle:.0f} s after {args.clients} vanished",
                  f"{(s1 - s0) / 1e6:+.1f} MB"),
                 ("clients", "engine cores, same time", f"{(c1 - c0) / 1e6:+.1f} MB"),
                 ("clients", "sidecar + cores", f"{(s1 + c1 - s0 - c0) / 1e6:+.1f} MB"),
                 ("clients", "groups / sequences still in flight", f"{clients['groups']} / {clients['sequences']}")]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.leaks", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a model directory or name (tiny, small, smollm2)")
    p.add_argument("--scenario", default="both", choices=["pushes", "clients", "both"])
    p.add_argument("--trainers", type=int, default=3, help="trainer processes killed mid-push")
    p.add_argument("--clients", type=int, default=200, help="clients that vanish mid-generate")
    p.add_argument("--per-process", type=int, default=10, help="clients per client process")
    p.add_argument("--prompts", type=int, default=2, help="prompts per generate call")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (random ids)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--settle", type=float, default=5.0, help="seconds after the last kill before measuring")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("WANDB_MODE", "offline")
    from engine.models.model_names import resolve_model_arg

    model_dir = resolve_model_arg(args.model)
    pushes = killed_pushes(model_dir, args.trainers) if args.scenario in ("pushes", "both") else None
    clients = vanished_clients(model_dir, args) if args.scenario in ("clients", "both") else None
    report(args, pushes, clients)


if __name__ == "__main__":
    main()
