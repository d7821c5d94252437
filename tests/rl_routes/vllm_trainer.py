"""A trainer written for vLLM's RL routes, run as its own process: vLLM's own control-plane client
(HTTPVLLMWeightSyncClient), vLLM's own group (stateless_init_torch_distributed_process_group, gloo)
and vLLM's own packing (pack_tensors), with the CPU path of vLLM PR #57374 (a broadcast, then a
barrier, per chunk). Pushes `--model`'s weights, perturbed by `--seed`, to the sidecar at `--url`.

    python -m tests.rl_routes.vllm_trainer --url http://127.0.0.1:8000 --model DIR --seed 1
"""

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import sys

import requests
import torch
from transformers import AutoModelForCausalLM
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perturbed(model_dir: str, seed: int):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--buffer-bytes", type=int, default=1 << 20)
    p.add_argument("--version", default=None, help="finish_weight_update's weight_version (default: none sent)")
    p.add_argument("--wrong-shape", action="store_true", help="send the last norm weight one element short")
    p.add_argument("--die-after", type=int, default=None, help="SIGKILL itself after this many chunks")
    p.add_argument("--pause", default=None, help="POST /pause?mode=... before the update, /resume after it")
    p.add_argument("--hold", action="store_true", help="once the group formed, print 'joined' and wait to be killed")
    p.add_argument("--token", default="", help="the sidecar's token, sent as the README shows")
    args = p.parse_args(argv)
    args.exit_on_refusal = True  # a process of its own: a refused init must not leave it in the group's wait
    try:
        print(json.dumps(push(args)), flush=True)
    except Exception as e:  # what the sidecar answered, for the test to read
        body = getattr(getattr(e, "response", None), "text", "")
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "body": body}), flush=True)
        return 1


def token_client(token: str):
    """vLLM's client with the sidecar's token on every call (README, "Drive it from a vLLM or TRL trainer")."""
    class TokenClient(HTTPVLLMWeightSyncClient):
        def _post(self, path, json=None):
            requests.post(f"{self.base_url}/{path}", json=json, timeout=self.timeout,
                          headers={"Authorization": f"Bearer {token}"}).raise_for_status()

    return TokenClient


def _exit_if_refused(init) -> None:
    e = init.exception()
    if e is not None:
        body = getattr(getattr(e, "response", None), "text", "")
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "body": body}), flush=True)
        os._exit(1)


def push_here(url: str, model: str, **options) -> dict:
    """The same trainer, in this process (tests: vLLM is imported once); options as the flags."""
    args = argparse.Namespace(url=url, model=model, seed=1, buffer_bytes=1 << 20, version=None, wrong_shape=False,
                              die_after=None, pause=None, hold=False, token="")
    vars(args).update(options)
    return push(args)


def push(args) -> dict:
    model = perturbed(args.model, args.seed)
    client = (token_client(args.token) if args.token else HTTPVLLMWeightSyncClient)(args.url, timeout=120)
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    got = requests.get(f"{args.url}/get_world_size", timeout=30, headers=headers)
    got.raise_for_status()
    world = 1 + got.json()["world_size"]
    port = free_port()
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world,
                 "packed": True, "packed_buffer_size_bytes": args.buffer_bytes, "packed_num_buffers": 2}
    if args.pause:
        requests.post(f"{args.url}/pause", params={"mode": args.pause}, timeout=120).raise_for_status()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weight_transfer_engine, init_info)  # the trainer joins meanwhile
        if getattr(args, "exit_on_refusal", False):
            joined.add_done_callback(_exit_if_refused)  # else it would wait for the group's timeout
        group = stateless_init_torch_distributed_process_group("127.0.0.1", port, 0, world, backend="gloo")
        joined.result()
        if args.hold:
            print("joined", flush=True)
            signal.pause()
        client.start_weight_update()
        named = [(n, t.detach()) for n, t in model.named_parameters()]  # ModuleSource: no tied lm_head
        if args.wrong_shape:
            named[-1] = (named[-1][0], named[-1][1][:-1])
        info = {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named]}
        updated = pool.submit(client.update_weights, info)  # vLLM's trainer asks on a thread while it sends
        chunks, it = 0, iter(named)
        try:
            while (chunk := pack_tensors(it, lambda item: item[1], args.buffer_bytes)) is not None:
                group.broadcast(chunk.packed_tensor, 0).wait()
                group.barrier().wait()
                chunks += 1
                if chunks == args.die_after:
                    os.kill(os.getpid(), signal.SIGKILL)
        finally:
            updated.result()  # the sidecar's answer first: it says why a broadcast broke
    client.finish_weight_update(args.version)
    if args.pause:
        requests.post(f"{args.url}/resume", timeout=120).raise_for_status()
    return {"chunks": chunks, "world_size": world}


if __name__ == "__main__":
    sys.exit(main())
