"""A trainer in its own process, for the tests that need one: it is rank 0 of a weight-sync group
and talks to the test over stdout (one JSON object per line) and stdin (one line = go on).

    python -m tests.weight_sync.trainer_proc --model DIR --mode stall|ddp [--timeout S]

stall: open a group, push once with small buckets and stop dead after a few buckets (the test
       SIGKILLs it there).
ddp:   with a default process group of its own (gloo, world 1): push a DDP-wrapped model, then
       DTensor-sharded weights, then show the default group still works.
"""

import argparse
import json
import os
import socket
import sys
import time

import torch


def say(**msg):
    print(json.dumps(msg), flush=True)


def wait_go():
    line = sys.stdin.readline()
    if not line:
        os._exit(3)


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def push(sender, weights, version, progress=None):
    prepared = sender.prepare(weights, version)
    say(manifest=prepared.manifest.to_json().decode(), checksum=sender.checksum(weights))
    result = sender.send(prepared, progress)
    say(sent=result)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--mode", choices=["stall", "ddp"], required=True)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from weight_sync import WeightSender

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.mode == "stall":
        sender = WeightSender(bucket_bytes=256 * 1024, timeout_s=args.timeout)
        say(info=sender.open_group(world_size=args.world_size))
        sender.join_group()
        perturb(model, 123)

        def stall(k, n):
            if k == 3:
                say(stalled=k, of=n)
                time.sleep(3600)

        push(sender, model, 77, stall)
        return

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    sender = WeightSender(bucket_bytes=1024 * 1024, timeout_s=args.timeout)
    say(info=sender.open_group(world_size=args.world_size))
    sender.join_group()
    perturb(model, 321)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    wait_go()
    push(sender, ddp, 11)
    mesh = init_device_mesh("cpu", (1,))
    perturb(model, 654)
    sharded = [(f"module.{n}", distribute_tensor(p.detach().clone(), mesh, [Shard(0)]))
               for n, p in model.named_parameters()]
    assert all(hasattr(t, "full_tensor") for _, t in sharded)
    wait_go()
    push(sender, sharded, 12)
    t = torch.ones(1)
    dist.all_reduce(t)  # the trainer's own group is untouched by the weight-sync group
    say(default_group_ok=bool(t.item() == 1.0), default_world=dist.get_world_size())
    sender.close_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
