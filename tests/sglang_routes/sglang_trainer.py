"""A trainer written for SGLang servers, run as its own process (or in the test's, `push_here`): the
trainer's end of the weight-update group and its HTTP calls as slime and AReaL make them. Pushes
`--model`'s weights, perturbed by `--seed`, to the sidecar at `--url`.

    python -m tests.sglang_routes.sglang_trainer --url http://127.0.0.1:8000 --model DIR --seed 1

Copied and adapted from their sources (not installed here):
- `init_process_group`: slime/utils/distributed_utils.py (THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515),
  itself a copy of torch's, as SGLang's `init_custom_process_group`;
- the group set-up, the bucketing and the per-bucket call + broadcasts: slime's
  slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py
  (`connect_rollout_engines_from_distributed`, `_iter_non_expert_chunks`, `update_weights_from_distributed`,
  `UpdateWeightFromDistributed.update_weights`), with Ray's remote calls as threads;
- the HTTP payloads: slime/backends/sglang_utils/sglang_engine.py (`init_weights_update_group`,
  `update_weights_from_distributed`, `pause_generation`, `flush_cache`, `continue_generation`);
- `--areal`: AReaL's areal/engine/sglang_remote.py (inclusionAI/AReaL@4aef98d8d818af55b43621aaadba047ae10f4e77,
  `build_init_weights_group_request`: the port as a string; `build_distributed_weight_update_requests`:
  `abort_all_requests`, no weight_version);
- `--flattened`: SGLang's `FlattenedTensorBucket` (python/sglang/srt/weight_sync/tensor_bucket.py): every
  tensor's bytes end to end as one uint8 tensor, `load_format="flattened_bucket"`.
"""

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import sys
from datetime import timedelta

import requests
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                default_pg_timeout, rendezvous)



def perturbed(model_dir: str, seed: int):
    """The checkpoint's weights moved by seeded noise (as tests/rl_routes/vllm_trainer.py's, without vLLM)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                       group_name=None, pg_options=None):
    """slime's (and SGLang's) copy of torch's init_process_group, to create a group besides the default one."""
    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                      backend_options=pg_options, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class SGLangServer:
    """The calls slime's SGLangEngine makes of one server (its `_make_request`: POST, raise_for_status, json)."""

    def __init__(self, url: str, token: str = ""):
        self.url = url
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def _make_request(self, endpoint: str, payload: dict | None = None):
        response = requests.post(f"{self.url}/{endpoint}", json=payload or {}, headers=self.headers, timeout=300)
        try:
            response.raise_for_status()
        except requests.exceptions.HTTPError as e:
            e.add_note(f"{response.text=}")
            raise
        return response.json()

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name, backend,
                                  areal=False):
        payload = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                   "world_size": world_size, "group_name": group_name, "backend": backend}
        if areal:  # AReaL's build_init_weights_group_request sends the port as a string
            payload["master_port"] = str(master_port)
        return self._make_request("init_weights_update_group", payload)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, flush_cache=False,
                                        weight_version=None, load_format=None, areal=False):
        payload = {"names": names, "dtypes": [str(dtype).replace("torch.", "") for dtype in dtypes],
                   "shapes": shapes, "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        if areal:  # AReaL's build_distributed_weight_update_requests
            keep = ("names", "dtypes", "shapes", "group_name", "load_format")
            payload = {k: v for k, v in payload.items() if k in keep} | {"abort_all_requests": True}
        return self._make_request("update_weights_from_distributed", payload)

    def pause_generation(self):
        requests.post(f"{self.url}/pause_generation", json={}, headers=self.headers, timeout=60).raise_for_status()

    def continue_generation(self):
        requests.post(f"{self.url}/continue_generation", json={}, headers=self.headers,
                      timeout=300).raise_for_status()

    def flush_cache(self):
        assert requests.get(f"{self.url}/flush_cache", headers=self.headers, timeout=60).status_code == 200


def chunks(named, buffer_size: int):
    """slime's `_iter_non_expert_chunks`: HF tensors bucketed up to --update-weight-buffer-size bytes."""
    buffer, size = [], 0
    for name, param in named:
        n = param.numel() * param.element_size()
        if buffer and size + n > buffer_size:
            yield buffer
            buffer, size = [], 0
        buffer.append((name, param))
        size += n
    if buffer:
        yield buffer


def push(args) -> dict:
    model = perturbed(args.model, args.seed)
    engine = SGLangServer(args.url, args.token)
    tp = requests.get(f"{args.url}/get_server_info", headers=engine.headers, timeout=30).json()["tp_size"]
    with socket.socket() as sock:  # slime's connect_rollout_engines_from_distributed
        sock.bind(("", 0))
        master_port = sock.getsockname()[1]
    world_size, group_name = tp + 1, "slime-pp_0"
    backend = getattr(args, "backend", "gloo")  # slime's accelerator.weight_update_backend(): nccl on CUDA
    if backend == "nccl":
        model.to("cuda")
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    if args.wrong_shape:
        named[-1] = (named[-1][0], named[-1][1][:-1])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joined = pool.submit(engine.init_weights_update_group, "127.0.0.1", master_port, 1, world_size, group_name,
                             backend, areal=args.areal)
        if getattr(args, "exit_on_refusal", False):
            joined.add_done_callback(_exit_if_failed)  # a process of its own: else it waits in the rendezvous
        group = init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{master_port}",
                                   world_size=world_size, rank=0, group_name=group_name,
                                   timeout=timedelta(seconds=60))
        joined.result()
        if args.hold:
            print("joined", flush=True)
            signal.pause()
        engine.pause_generation()  # UpdateWeightFromDistributed.update_weights
        engine.flush_cache()
        sent = 0
        for bucket in chunks(named, args.buffer_bytes):
            ref = pool.submit(engine.update_weights_from_distributed, [n for n, _ in bucket],
                              [p.dtype for _, p in bucket], [list(p.shape) for _, p in bucket], group_name,
                              weight_version=args.version, load_format="flattened_bucket" if args.flattened else None,
                              areal=args.areal)
            try:
                if args.flattened:
                    flat = torch.cat([p.flatten().view(torch.uint8) for _, p in bucket])
                    dist.broadcast(flat, 0, group=group)
                else:
                    handles = [dist.broadcast(p.data, 0, group=group, async_op=True) for _, p in bucket]
                    for handle in handles:
                        handle.wait()
            finally:
                ref.result()  # the server's answer first: it says why a broadcast broke
            sent += 1
            if sent == args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
        engine.continue_generation()
    # slime's disconnect_rollout_engines_from_distributed: the trainer is done with its group
    engine._make_request("destroy_weights_update_group", {"group_name": group_name})
    dist.destroy_process_group(group)
    return {"buckets": sent, "world_size": world_size}


def _exit_if_failed(init) -> None:
    e = init.exception()
    if e is not None:
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "body": getattr(e.response, "text", "")}), flush=True)
        os._exit(1)


def push_here(url: str, model: str, **options) -> dict:
    """The same trainer, in this process; options as the flags."""
    args = argparse.Namespace(url=url, model=model, seed=1, buffer_bytes=1 << 20, version=None, wrong_shape=False,
                              die_after=None, hold=False, token="", flattened=False, areal=False,
                              backend="gloo")
    vars(args).update(options)
    return push(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--buffer-bytes", type=int, default=1 << 20, help="slime's --update-weight-buffer-size")
    p.add_argument("--version", default=None, help="the weight_version sent with every bucket")
    p.add_argument("--wrong-shape", action="store_true", help="send the last weight one row short")
    p.add_argument("--die-after", type=int, default=None, help="SIGKILL itself after this many buckets")
    p.add_argument("--hold", action="store_true", help="once the group formed, print 'joined' and wait")
    p.add_argument("--flattened", action="store_true", help="load_format flattened_bucket")
    p.add_argument("--areal", action="store_true", help="AReaL's payloads")
    p.add_argument("--token", default="")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    args = p.parse_args(argv)
    args.exit_on_refusal = True
    try:
        print(json.dumps(push(args)), flush=True)
    except Exception as e:  # what the sidecar answered, for the test to read
        body = getattr(getattr(e, "response", None), "text", "")
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "body": body}), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
