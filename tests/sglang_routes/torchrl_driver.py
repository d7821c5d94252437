"""TorchRL's SGLang weight sync (tests/sglang_routes/torchrl_trainer.py, TorchRL's code) driven against
a sidecar with SGLang's routes, in a process of its own, as TorchRL's GRPO sets it up
(pytorch/rl@ae9719f17b1517af5c2523a36c4616f003ee55cf, sota-implementations/grpo/grpo-sync.py and
grpo_utils.py `_make_sglang_weight_sync_scheme`): a scheme of tp_size x dp_size GPUs from the server's
info with strategy "state_dict", register_model, get_model_metadata, init_all_workers_group,
register_collector, then update_weights() after every training step.

    python -m tests.sglang_routes.torchrl_driver --url http://127.0.0.1:8000 --model DIR --seed 1 --steps 2

Prints one JSON line: `checksum` (the policy's weights after its last update), `policy_version` (its
collector's), `group`, `world_size`; or `error` and `answers` (the server's non-2xx answers: TorchRL
raises its collective's error before it reads the HTTP answer). Test hooks, not TorchRL's:
--stall-at K: the broadcast loop blocks before its K-th tensor, printing `{"stalled", "group"}`, until a
line arrives on stdin (a trainer frozen mid-update; the test may SIGKILL it there);
--spoil wrong-shape|untied (repeatable): first a policy the engines cannot take (model.norm.weight one
element short; lm_head.weight untied from the embedding), each through a fresh scheme and sender (as a
restarted trainer), its failure reported in `refused`, then the good policy;
--timeout T: the transport's timeout (TorchRL's default, 300 s, is how long a refused init waits).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import requests
import torch

from tests.sglang_routes import torchrl_trainer as trl
from weight_sync import weights_checksum

ANSWERS: list[dict] = []
TRANSPORTS: list[trl.SGLangCollectiveTransport] = []


def policy(model_dir: str, seed: int, steps: int):
    """The checkpoint after `steps` training steps (seeded noise stands for an optimizer's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for step in range(steps):
        train_step(model, seed, step)
    return model


def train_step(model, seed: int, step: int) -> None:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


class Collector:
    """What TorchRL's sender calls of a registered collector."""

    def __init__(self):
        self.policy_version = 0

    def increment_version(self) -> None:
        self.policy_version += 1


class StallingWeights(dict):
    """A state dict whose `k`-th tensor, read the second time (TorchRL reads each for its metadata check,
    then in the broadcast loop), blocks until a line arrives on stdin."""

    def __init__(self, weights: dict, k: int, group):
        super().__init__(weights)
        self.name, self.group, self.reads = list(weights)[k], group, 0

    def __getitem__(self, name):
        if name == self.name:
            self.reads += 1
            if self.reads == 2:
                print(json.dumps({"stalled": name, "group": self.group()}), flush=True)
                sys.stdin.readline()
        return super().__getitem__(name)


def _recording(call):
    def answered(url, *args, **kwargs):
        response = call(url, *args, **kwargs)
        if response.status_code >= 400:
            ANSWERS.append({"route": url.rsplit("/", 1)[-1], "status": response.status_code, "body": response.text})
        return response
    return answered


def make_scheme(url: str, master_address: str, timeout: float | None) -> trl.SGLangWeightSyncScheme:
    """grpo_utils._make_sglang_weight_sync_scheme, with AsyncSGLang's read of the server's info."""
    info = trl.get_server_info(url)
    scheme = trl.SGLangWeightSyncScheme(server_url=url, master_address=master_address,
                                        master_port=trl.get_open_port(),
                                        num_gpus=info.get("tp_size", 1) * info.get("dp_size", 1),
                                        strategy="state_dict", device=0)
    create = scheme.create_transport

    def create_transport(**kwargs):  # kept, to wait for the HTTP answers it did not wait for
        transport = create(**kwargs)
        transport.timeout = transport.timeout if timeout is None else timeout
        TRANSPORTS.append(transport)
        return transport
    scheme.create_transport = create_transport
    return scheme


def answers() -> list[dict]:
    """The server's non-2xx answers so far, once every call in flight is answered."""
    for transport in TRANSPORTS:
        transport._http_executor.shutdown(wait=True)
    return list(ANSWERS)


def sync(args, model, collector: Collector) -> trl.SGLangWeightSender:
    """grpo-sync.py's set-up and first update_weights(); then one update per further step."""
    scheme = make_scheme(args.url, args.master_address, args.timeout)
    sender = scheme.create_sender()
    sender.register_model(model)
    metadata = trl.get_model_metadata(model)
    sender.init_all_workers_group(metadata)
    sender.register_collector(collector)
    group = (lambda: sender._transport._group_name)
    for step in range(args.steps):
        if step:
            train_step(model, args.seed, step)
        if args.stall_at is not None and step == args.steps - 1:
            sender.update_weights(StallingWeights(model.state_dict(), args.stall_at, group))
        else:
            sender.update_weights()
    return sender


def spoil(model, how: str):
    """The policy made one the engines cannot take (TorchRL's metadata follows it); returns the undo."""
    if how == "wrong-shape":  # model.norm.weight one element short
        good = model.model.norm.weight
        model.model.norm.weight = torch.nn.Parameter(good.detach()[:-1].clone())
        return lambda: setattr(model.model, "norm", _with_weight(model.model.norm, good))
    # "untied": lm_head.weight no longer the embedding (the engines tie them)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach() + 0.01)
    return lambda: setattr(model.lm_head, "weight", model.model.embed_tokens.weight)


def _with_weight(module, weight):
    module.weight = weight
    return module


def run(args) -> dict:
    """Each --spoil'ed policy (each must fail: `refused` says how it did), then the good one."""
    trl.BACKEND = args.backend
    model = policy(args.model, args.seed, 1)
    collector, refused = Collector(), []
    for how in args.spoil:
        undo = spoil(model, how)
        try:
            sync(args, model, collector).shutdown()
            refused.append({"how": how, "error": "it landed"})
        except Exception as e:
            refused.append({"how": how, "error": f"{type(e).__name__}: {e}", "answers": answers()})
            ANSWERS.clear()
        undo()
    return {**_pushed(sync(args, model, collector), model, collector), "refused": refused}


def _pushed(sender, model, collector: Collector) -> dict:
    out = {"checksum": weights_checksum(model.named_parameters()), "policy_version": collector.policy_version,
           "group": sender._transport._group_name, "world_size": sender._transport.world_size}
    sender.shutdown()
    return out


def sync_here(url: str, model: str, **flags) -> dict:
    """The same trainer, in this process (a good update only: a refused init leaves a thread waiting)."""
    return run(_parser().parse_args(["--url", url, "--model", model,
                                     *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items())]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=1, help="training steps, an update_weights() after each")
    p.add_argument("--master-address", default="127.0.0.1")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--stall-at", type=int, default=None)
    p.add_argument("--spoil", action="append", default=[], choices=("wrong-shape", "untied"))
    p.add_argument("--timeout", type=float, default=None)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    requests.post, requests.get = _recording(requests.post), _recording(requests.get)
    try:
        out, code = run(args), 0
    except Exception as e:
        out, code = {"error": f"{type(e).__name__}: {e}", "answers": answers()}, 1
    print(json.dumps(out), flush=True)
    os._exit(code)  # TorchRL's group thread of a refused init still waits in the rendezvous


if __name__ == "__main__":
    main()
