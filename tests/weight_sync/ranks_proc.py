"""One rank of a 2-rank trainer (gloo default group) pushing to a real sidecar: rank 0 through
RolloutClient, rank 1 through follow_push. Prints one JSON line when done.

    python -m tests.weight_sync.ranks_proc --url URL --token T --model DIR --rank R --port P --wrap ddp|fsdp2
"""

import argparse
import json

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    for flag in ("--url", "--token", "--model", "--wrap"):
        p.add_argument(flag, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--version", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    from transformers import AutoModelForCausalLM

    from weight_sync import follow_push, weights_checksum

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.02)
    plain = weights_checksum(model.named_parameters())  # before any wrapper: the full model
    if args.wrap == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    if args.rank == 0:
        from rollout import RolloutClient

        with RolloutClient(args.url, token=args.token) as client:
            client.init_weight_sync()
            client.push_weights(wrapped, version=args.version)
            out = {"plain": plain, "want": client.checksum_of(wrapped), "got": client.weights_checksums()}
    else:
        out = {"passes": [follow_push(wrapped), follow_push(wrapped)]}  # the push, then the checksum
    t = torch.ones(1)
    dist.all_reduce(t)  # the trainer's own group still works
    out["group_ok"] = t.item() == 2.0
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
