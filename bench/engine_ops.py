"""What the host does per engine step: aten ops, tensors built from Python data, device syncs.

On a GPU a decode step is host-bound when the host issues more work than the GPU takes to run
it: every aten op is a kernel launch (or several), every tensor built from Python data a
host-to-device copy, every `.tolist()` / `.item()` a sync that drains the queue. This counts
them, with a `TorchDispatchMode`, for one decode step and one prefill step of the engine core
(`EngineCore.step`: forward, sampling, everything), at several batch sizes and with the batch's
prompts in 1 or 8 length groups, with and without per-request seeds. Then it times decode on
the tiny model (host time is all there is there: the proxy for a GPU's host-bound step) and,
with `--real`, SmolLM2's decode as a fraction of the matmul peak probed in the same run.

    python -m bench.engine_ops                  # counts at batch 16/64/256, tiny-model decode tok/s
    python -m bench.engine_ops --real smollm2   # adds SmolLM2's decode FLOP/s vs the matmul peak
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("bench.engine_ops")

# the goals of issue 27: per decode step
OPS_PER_LAYER_GOAL, OPS_FIXED_GOAL, FROM_PYTHON_GOAL, SYNCS_GOAL = 40, 150, 2, 1
# aten ops that only re-describe a tensor: no kernel on any device (counted, reported apart)
VIEW_OPS = {"view", "_unsafe_view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "t",
            "slice", "select", "alias", "as_strided", "detach", "split", "unbind", "flatten", "narrow",
            "split_with_sizes", "chunk", "lift_fresh", "_reshape_alias", "view_as", "unflatten"}


@dataclass
class Counts:
    ops: int = 0
    views: int = 0  # of ops: view-only (no kernel)
    from_python: int = 0  # tensors built from Python data (a host-to-device copy each on a GPU)
    syncs: int = 0  # device-to-host reads the host waits for (tolist, item, bool of a tensor)
    by_op: collections.Counter = field(default_factory=collections.Counter)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        c = self.counts
        c.ops += 1
        c.by_op[name] += 1
        if name in VIEW_OPS:
            c.views += 1
        if name == "lift_fresh":
            c.from_python += 1
        if name == "_local_scalar_dense":
            c.syncs += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    """Count ops inside; `.tolist()` is counted by hand (on the CPU it reads memory without a
    dispatch, on a GPU it is a sync)."""
    counter = OpCounter()
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counter.counts.syncs += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            yield counter.counts
    finally:
        torch.Tensor.tolist = tolist


def prompts_for(batch: int, groups: int, vocab: int, block_size: int) -> list[list[int]]:
    """`batch` prompts in `groups` lengths that differ in their block counts (8 groups: the
    spread of a GRPO batch with prompts of 1-8 blocks)."""
    g = torch.Generator().manual_seed(batch * 10 + groups)
    lengths = [block_size * (1 + i % groups) + 3 for i in range(batch)]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def make_core(model_dir: str, max_num_seqs: int, max_model_len: int, dtype: str = "float32"):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    cfg = EngineConfig(model=model_dir, device="cpu", dtype=dtype, max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, max_num_batched_tokens=max(4096, max_model_len) * 8,
                       num_threads=torch.get_num_threads(), enable_prefix_caching=False)
    return EngineCore(cfg)


def fill(core, prompts: list[list[int]], seeded: bool, max_tokens: int) -> None:
    from engine.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i if seeded else None)
        core.add_request(uuid.uuid4().hex, p, params)


def count_steps(core, prompts, seeded: bool) -> tuple[Counts, Counts]:
    """(prefill step, decode step) counts for this batch; the core is drained after."""
    fill(core, prompts, seeded, max_tokens=8)
    with counting() as prefill:
        core.step()
    while any(s.num_output_tokens == 0 for seqs in core.requests.values() for s in seqs):
        core.step()  # the rest of the prefill, if the batch took several steps
    core.step()  # one decode step first: buffers grown, caches warm
    with counting() as decode:
        core.step()
    while core.has_unfinished():
        core.step()
    return prefill, decode


def decode_tokens_per_s(core, prompts, seconds: float = 3.0) -> float:
    """Decode-only tokens/s of a full batch: steps timed after every prompt is prefilled."""
    fill(core, prompts, seeded=True, max_tokens=10_000)
    while any(s.num_output_tokens == 0 for seqs in core.requests.values() for s in seqs):
        core.step()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        core.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    core.abort_requests(list(core.requests))
    return steps * len(prompts) / elapsed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,64,256", help="decode batch sizes to count at")
    ap.add_argument("--seconds", type=float, default=4.0, help="how long each decode timing runs")
    ap.add_argument("--real", default=None, help="also time this real model's decode (e.g. smollm2), fp32")
    ap.add_argument("--top", type=int, default=12, help="list the most frequent ops of the largest decode step")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from engine.models.tiny_model import default_model_dir

    batches = [int(b) for b in args.batches.split(",")]
    model_dir = str(default_model_dir())
    core = make_core(model_dir, max(batches), 512)
    layers, vocab, bs = core.runner.num_layers, core.runner.vocab_size, core.cfg.block_size
    goal = OPS_PER_LAYER_GOAL * layers + OPS_FIXED_GOAL
    print(f"tiny model: {layers} layers; goal per decode step: <= {goal} aten ops, <= {FROM_PYTHON_GOAL} "
          f"tensors from Python data, {SYNCS_GOAL} sync")
    print("decode ops: as the CPU cuts the batch (chunks where padding costs more than a chunk) and with the "
          "batch in one chunk (the cut on a GPU); prefill ops: per-span calls (CPU) and padded into one call (GPU)")
    print(f"{'batch':>5} {'groups':>6} {'seeds':>5} | {'decode ops':>10} {'(views)':>7} {'1 chunk':>7} {'from py':>7} "
          f"{'syncs':>5} | {'prefill ops':>11} {'padded':>6} {'from py':>7} {'syncs':>5}")
    largest = None
    for batch in batches:
        for groups in (1, 8):
            for seeded in (True, False):
                prompts = prompts_for(batch, groups, vocab, bs)
                pre, dec = count_steps(core, prompts, seeded)
                core.runner.decode_chunk_cost, core.runner.padded_prefill = float("inf"), True  # a GPU's paths
                gpu_pre, one = count_steps(core, prompts, seeded)
                core.runner.decode_chunk_cost, core.runner.padded_prefill = 1.0, False
                largest = one if batch == max(batches) and groups == 8 and seeded else largest
                print(f"{batch:>5} {groups:>6} {'yes' if seeded else 'no':>5} | {dec.ops:>10} {dec.views:>7} "
                      f"{one.ops:>7} {dec.from_python:>7} {dec.syncs:>5} | {pre.ops:>11} {gpu_pre.ops:>6} {pre.from_python:>7} "
                      f"{pre.syncs:>5}")
    if largest is not None and args.top:
        print(f"most frequent ops of the batch-{max(batches)} 8-group seeded one-chunk decode step:",
              ", ".join(f"{k} {v}" for k, v in largest.by_op.most_common(args.top)))
    b = max(batches)
    for cost, label in ((1.0, "CPU cut"), (float("inf"), "one chunk")):
        core.runner.decode_chunk_cost = cost
        tps = decode_tokens_per_s(core, prompts_for(b, 8, vocab, bs), args.seconds)
        print(f"tiny model decode, batch {b}, 8 length groups, seeded, {label}: {tps:.0f} tok/s")
    if args.real:
        real_decode(args.real, args.seconds)


def real_decode(name: str, seconds: float) -> None:
    from bench.engines import probe_peak
    from engine.models.real_models import real_model_dir

    model_dir = str(real_model_dir(name))
    core = make_core(model_dir, 64, 1024)
    params = sum(p.numel() for p in core.runner.model.parameters())
    prompts = prompts_for(64, 8, core.runner.vocab_size, core.cfg.block_size)
    peak = probe_peak("float32")
    for cost, label in ((1.0, "CPU cut"), (float("inf"), "one chunk")):
        core.runner.decode_chunk_cost = cost
        tps = decode_tokens_per_s(core, prompts, seconds * 3)
        print(f"{name} decode, batch 64, fp32, {label}: {tps:.1f} tok/s = {2 * params * tps / 1e9:.1f} GFLOP/s, "
              f"{2 * params * tps / peak:.1%} of the {peak / 1e9:.1f} GFLOP/s matmul peak probed")


if __name__ == "__main__":
    main()
