"""Four ways to run the same RL-shaped rollout batch, side by side in one run (issue 31):

  (a) vllm       bare vLLM: `vllm.LLM.generate` offline, the sidecar's engine arguments
                 (engine/vllm_start.engine_args) but with vLLM's own default of torch.compile on, as
                 its users run it (the sidecar passes enforce_eager on CPU: compiling costs it a
                 minute or two at each start); --vllm-eager runs it eager
  (b) sidecar-vllm    `python -m rollout.serve --engine vllm`, driven by `rollout.RolloutClient.generate`
  (c) sidecar-native  `python -m rollout.serve --engine native`, the same client
  (d) ours       this project's `engine.LLM.generate`, in process
  (e) ours int8  the same, serving from int8 copies of the weights (EngineConfig(quantization="int8"))

The workload is bench.engine_throughput's: P prompts x n=8 samples, random prompt ids of 16-128
tokens, a max_tokens of 16-128 drawn per prompt, temperature 1, EOS ignored, so every system
generates exactly the tokens asked for. No request carries a seed (vLLM's CPU build cannot take
one); every request asks for the sampled tokens' logprobs (logprobs=0: what an RL trainer needs,
and what the sidecar always asks of vLLM). Each engine starts once per dtype and is warmed up
before its timed runs. It prints tokens/s, each as a fraction of the matmul peak probed in this
run (bench.gpu.matmul_peak, FLOPs counted as bench.gpu does: 2 x params per token, an MoE's active
ones) and of the run's memory read bound (bench/read_bound.py: every weight read once a step, each sequence's KV once a
decode step, at the memory read probe's rate; for a mixture of experts every expert is counted), and the ratios
b/a (goal >= 0.95: the sidecar costs a vLLM user at most 5%), d/a (our engine against vLLM),
c/d (our sidecar against our engine) and e/d, e/a (our int8 engine against ours and vLLM in the dtype
its weights come in), each also per CPU second: the CPU time of this process and
all its descendants (engine cores, sidecars) over the run, which on cores shared with other jobs
says what a system costs when its wall time says mostly how busy the neighbours were.

    .venv-vllm/bin/python -m bench.engines                        # SmolLM2-135M, fp32 + bf16, 32 + 256 seqs
    .venv-vllm/bin/python -m bench.engines --quick                # smoke run: tiny model, small workload
    .venv-vllm/bin/python -m bench.engines --dtypes bfloat16 --engines a,b --seqs 256

Every system runs under vLLM's documented CPU set-up (bench/vllm_cpu_setup.py: tcmalloc and Intel
OpenMP preloaded, OpenMP threads bound to every core): the bench starts itself again with it, says
so in its output, and warns when a library is missing. Without it vLLM's bf16 figure here was a
third lower, which once made a 3.41x lead of ours out of a 0.76-0.90x deficit.

On a CPU shared with other jobs, set OMP_WAIT_POLICY=PASSIVE for every system (the sidecars and
vLLM's processes inherit it): with more runnable threads than cores, OpenMP's spinning barriers
cost our engine ~10x at 2 threads (vLLM's pinned workers much less), and the figures would
measure the neighbours. vLLM's CPU guide asks for AVX-512 for bf16 (fp16 is cast to bf16): on a CPU
without it (AVX2 only) its users run the model in fp32, and so do (a) and (b) here (`vllm_dtype`; the
report says so): in bf16 there its CPU build took 8 minutes to start a 1B model and had not finished
warming up 9 later. There a bf16 share of "peak" is of the fp32 probe (`probe_peak`): every engine's
linears run in fp32 (ours on bf16 panels widened as loaded), and torch's bf16 matmul crawls.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.engine_throughput import Workload, make_workload
from bench.amx_linears import read_bandwidth
from bench.gpu import matmul_peak

log = logging.getLogger("bench.engines")

ENGINES = {"a": "vLLM LLM.generate", "b": "sidecar --engine vllm", "c": "sidecar --engine native",
           "d": "engine.LLM (ours)", "e": "engine.LLM int8 (ours)"}
TARGET_B_OVER_A = 0.95
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class Row:
    engine: str  # a, b, c, d
    dtype: str
    seqs: int
    tokens: int  # generated (== the workload's useful tokens unless something is off)
    seconds: float
    probe: float  # matmul FLOP/s probed right before this engine's timed runs
    cpu_s: float  # CPU seconds (user + system) of this process and all its descendants in that run
    read_probe: float = 0.0  # memory read bytes/s probed right before them

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds

    @property
    def tpc(self) -> float:
        """Tokens per CPU second: what the system costs, nearly independent of the neighbours' load."""
        return self.tokens / self.cpu_s


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and every live descendant (an engine core, a
    sidecar and its processes): a timed run's CPU cost is the difference around it."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        total += t.user + t.system
    return total


def count_params(model_dir: str) -> int:
    """Parameters of the checkpoint, from its safetensors headers (no load); a tied output head is
    the embedding, counted once (as `model.parameters()` counts it)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def active_params(model_dir: str) -> int:
    """Parameters a token's forward multiplies by, for the FLOPs of "of peak": all of a dense model's;
    of a mixture of experts, the experts' tensors (names with `.experts.`) at top_k / experts (a
    count of every expert made the MoE rows read over 100% of the matmul peak)."""
    from safetensors import safe_open

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    total, expert = 0, 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = math.prod(st.get_slice(name).get_shape())
                total += n
                expert += n if ".experts." in name else 0
    return total if not (experts and top_k) else total - expert + expert * top_k // experts


def probe_peak(dtype: str, tries: int = 3) -> float:
    """The best of a few bench.gpu.matmul_peak probes (CPU: one 1024^3 matmul x 5), FLOP/s. A half-precision
    dtype on a CPU without AVX-512 is probed in fp32: there every engine's linears run on fp32 (ours on an fp32
    copy, vLLM in fp32: `vllm_dtype`), and torch's bf16 matmul crawls at ~1 GFLOP/s."""
    if vllm_dtype(dtype) != dtype:
        dtype = "float32"
    return max(matmul_peak(torch.device("cpu"), getattr(torch, dtype)) for _ in range(tries))


# -- the four systems: start (once per dtype), run(workload) -> tokens generated, close ---------------


class VllmOffline:
    """(a) vLLM's offline LLM with the engine arguments the sidecar's VllmEngine gives its AsyncLLM."""

    eager = False  # vLLM's own default on CPU compiles (bench.engines --vllm-eager: the sidecar's setting)

    def __init__(self, model_dir: str, dtype: str, max_num_seqs: int, max_model_len: int, seed: int):
        from dataclasses import fields

        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        from engine.config import EngineConfig
        from engine.vllm_start import engine_args

        cfg = EngineConfig(model=model_dir, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           seed=seed, gpu_memory_utilization=0.3)  # as rollout.serve's vLLM engines on CPU
        names = {f.name for f in fields(EngineArgs)}  # AsyncLLM's arguments less its own (enable_log_requests)
        args = {k: v for k, v in vars(engine_args(cfg, 1, on_cpu=True)).items() if k in names}
        self.llm = LLM(**{**args, "enforce_eager": self.eager})

    def run(self, wl: Workload) -> int:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(n=wl.n, temperature=1.0, max_tokens=k, ignore_eos=True, logprobs=0)
                  for k in wl.max_tokens]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in wl.prompts], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


class Sidecar:
    """(b), (c) `python -m rollout.serve --engine ENGINE` and a RolloutClient."""

    def __init__(self, engine: str, model_dir: str, dtype: str, max_num_seqs: int, max_model_len: int, seed: int):
        from rollout import RolloutClient
        from rollout.launcher import LocalSidecar

        self.side = LocalSidecar(model_dir, "--engine", engine, "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
                                 "--max-model-len", str(max_model_len), "--seed", str(seed), "--stats-interval", "0",
                                 "--log-level", "WARNING", "--host-copy", "off", "--warm-standby", "off",
                                 timeout_s=900.0)
        self.client = RolloutClient(self.side.url)
        from bench.settle import wait_settled

        wait_settled(self.client.health)  # as (d) waits for its collapser: the steady state a long run serves

    def run(self, wl: Workload) -> int:
        from engine import SamplingParams

        params = [SamplingParams(n=wl.n, temperature=1.0, max_tokens=k, ignore_eos=True) for k in wl.max_tokens]
        groups = self.client.generate(wl.prompts, params)
        return sum(len(r.token_ids) for g in groups for r in g)

    def close(self) -> None:
        self.client.close()
        self.side.stop()


class Ours:
    """(d) engine.LLM in this process; (e) the same serving from int8 copies of its `dtype` weights."""

    def __init__(self, model_dir: str, dtype: str, max_num_seqs: int, max_model_len: int, seed: int,
                 quantization: str = "none"):
        from engine import LLM, EngineConfig
        from engine.model_runner import available_cpus

        self.llm = LLM(EngineConfig(model=model_dir, dtype=dtype, max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len, seed=seed, num_threads=available_cpus(),
                                    quantization=quantization))
        collapser = getattr(self.llm.core.worker, "collapser", None)  # its weights onto 2 MB pages, in the
        if collapser is not None and not collapser.idle.wait(600):  # background (engine/kernels/huge_pages.py): as
            log.warning("the weights were not all on 2 MB pages after 600 s")  # a long run serves, not its start

    def run(self, wl: Workload) -> int:
        from engine import SamplingParams

        params = [SamplingParams(n=wl.n, temperature=1.0, max_tokens=k, ignore_eos=True) for k in wl.max_tokens]
        outs = self.llm.generate(wl.prompts, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def close(self) -> None:
        del self.llm


def vllm_dtype(dtype: str) -> str:
    """The dtype vLLM's CPU build serves a `dtype` model in here, as its users would run it: its install guide
    asks for AVX-512 for bf16 (and casts fp16 to bf16), so without AVX-512 (an AVX2 CPU) they run fp32."""
    from engine.kernels.native_kernels import cpu_flags

    return "float32" if dtype in ("bfloat16", "float16") and "avx512f" not in cpu_flags() else dtype


def start(key: str, model_dir: str, dtype: str, *args):
    served = vllm_dtype(dtype) if key in "ab" else dtype
    if served != dtype:
        log.info("%s: %s needs AVX-512 in vLLM's CPU build (its install guide): it serves the model in %s here",
                 ENGINES[key], dtype, served)
    args = (model_dir, served, *args)
    if key == "a":
        return VllmOffline(*args)
    if key in "bc":
        return Sidecar("vllm" if key == "b" else "native", *args)
    return Ours(*args, quantization="int8" if key == "e" else "none")


def run_engine(key: str, dtype: str, model_dir: str, workloads: dict[int, Workload], warm: Workload,
               max_num_seqs: int, max_model_len: int, seed: int, repeats: int = 1) -> list[Row]:
    log.info("%s (%s): starting", ENGINES[key], dtype)
    t0 = time.perf_counter()
    system = start(key, model_dir, dtype, max_num_seqs, max_model_len, seed)
    rows = []
    try:
        log.info("%s (%s): started in %.1f s; warming up", ENGINES[key], dtype, time.perf_counter() - t0)
        system.run(warm)
        probe = probe_peak(dtype, tries=1 if dtype != "float32" else 3)  # no bf16 matmul units: ~15 s a probe
        read_probe = max(read_bandwidth() for _ in range(3))
        for seqs, wl in workloads.items():
            times, cpus = [], []
            for _ in range(repeats):
                c0, t0 = tree_cpu_seconds(), time.perf_counter()
                tokens = system.run(wl)
                times.append(time.perf_counter() - t0)
                cpus.append(tree_cpu_seconds() - c0)
            best = min(range(repeats), key=times.__getitem__)  # the fastest: others' load only slows a run
            seconds, cpu_s = times[best], cpus[best]
            if tokens != wl.useful_tokens:
                log.warning("%s generated %d tokens, the workload asked for %d", ENGINES[key], tokens, wl.useful_tokens)
            rows.append(Row(key, dtype, seqs, tokens, seconds, probe, cpu_s, read_probe))
            log.info("%s (%s), %d seqs: %d tokens in %s s, %.1f tok/s, %.1f CPU s (probe %.1f GFLOP/s)",
                     ENGINES[key], dtype, seqs, tokens, " / ".join(f"{t:.1f}" for t in times), rows[-1].tps, cpu_s,
                     probe / 1e9)
    finally:
        system.close()
        del system
        gc.collect()
    return rows


# -- report ----------------------------------------------------------------------------------------


def shares(r: Row, peaks: dict[str, float], num_params: int, read_bound: dict | None,
           bandwidth: float | None) -> tuple[float, float | None]:
    """Row r's share of its dtype's matmul peak and of its memory read bound (None without one)."""
    read = (read_bound or {}).get((r.dtype, r.seqs))
    return 2 * num_params * r.tps / peaks[r.dtype], read / bandwidth / r.seconds if read and bandwidth else None


def report(rows: list[Row], peaks: dict[str, float], num_params: int, read_bound: dict | None = None,
           bandwidth: float | None = None) -> str:
    """One line per (dtype, seqs, system): tok/s, the share of the dtype's matmul peak (2 x
    `num_params` FLOPs a token: `active_params`) and of the run's memory read bound
    (bench/read_bound.py: `read_bound[(dtype, seqs)]` bytes over `bandwidth`); then the ratios."""
    lines = [f"{'dtype':<5} {'seqs':>5} {'system':<26} {'tokens':>7} {'s':>7} {'tok/s':>8} {'of peak':>8} "
             f"{'of read':>8} {'probe GF/s':>10} {'CPU s':>7} {'tok/CPU-s':>9}"]
    for r in rows:
        share, read = shares(r, peaks, num_params, read_bound, bandwidth)
        of_read = f"{read:>8.2%}" if read is not None else f"{'-':>8}"
        lines.append(f"{SHORT_DTYPE.get(r.dtype, r.dtype):<5} {r.seqs:>5} {r.engine + ') ' + ENGINES[r.engine]:<26} "
                     f"{r.tokens:>7} {r.seconds:>7.1f} {r.tps:>8.1f} {share:>8.2%} {of_read} {r.probe / 1e9:>10.1f} "
                     f"{r.cpu_s:>7.1f} {r.tpc:>9.1f}")
    lines.append("peaks (best matmul probe of the run): " + ", ".join(
        f"{SHORT_DTYPE.get(d, d)} {p / 1e9:.1f} GFLOP/s" for d, p in peaks.items()))
    if bandwidth:
        lines.append(f"of read: the run's memory read bound (every weight once a step, each sequence's KV once a "
                     f"decode step: bench/read_bound.py) at the read probe's {bandwidth / 1e9:.1f} GB/s, over its time")
    for dtype in dict.fromkeys(r.dtype for r in rows if r.engine in "ab" and vllm_dtype(r.dtype) != r.dtype):
        lines.append(f"vLLM's {SHORT_DTYPE.get(dtype, dtype)} rows (a, b) served the model in {vllm_dtype(dtype)}: "
                     f"its CPU build's {dtype} needs AVX-512 (its install guide), which this CPU lacks")
    by = {(r.dtype, r.seqs, r.engine): r for r in rows}
    lines.append("ratios: tok/s (wall), and in brackets tok per CPU-s (what each system costs in CPU; on cores "
                 "shared with other jobs the wall ratio measures the neighbours too)")
    for dtype, seqs in dict.fromkeys((r.dtype, r.seqs) for r in rows):
        parts = []
        for num, den, goal in (("b", "a", TARGET_B_OVER_A), ("d", "a", None), ("c", "d", None), ("e", "d", None),
                               ("e", "a", None)):
            if (dtype, seqs, num) in by and (dtype, seqs, den) in by:
                x, y = by[dtype, seqs, num], by[dtype, seqs, den]
                ratio, cpu_ratio = x.tps / y.tps, x.tpc / y.tpc
                verdict = "" if goal is None else (f" (goal >= {goal}: wall {'ok' if ratio >= goal else 'MISSED'}, "
                                                   f"CPU {'ok' if cpu_ratio >= goal else 'MISSED'})")
                parts.append(f"{num}/{den} {ratio:.2f} [{cpu_ratio:.2f}]{verdict}")
        if parts:
            lines.append(f"{SHORT_DTYPE.get(dtype, dtype)} {seqs:>4} seqs: " + "; ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from engine.models.model_names import MODEL_HELP

    p = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: smollm2; tiny with --quick)")
    p.add_argument("--dtypes", default=None, help="comma-separated (default: float32,bfloat16; --quick: float32)")
    p.add_argument("--seqs", default=None,
                   help="comma-separated workload sizes in sequences, P prompts x n each (default: 32,256; --quick: 8,16)")
    p.add_argument("--engines", default="a,b,c,d,e", help="which systems, comma-separated: " +
                   ", ".join(f"{k}: {v}" for k, v in ENGINES.items()) + " (default: all)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default: 8; --quick: 4)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="per-prompt max_tokens, drawn uniformly (default: 16 128; --quick: 8 32)")
    p.add_argument("--vllm-kv-gib", type=float, default=4.0,
                   help="VLLM_CPU_KVCACHE_SPACE unless set (default: 4 GiB, room for the whole 256-sequence batch "
                        "in fp32, as our engine sizes its cache; the sidecar's own default of 1 would preempt)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each workload per engine; the fastest counts (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="workload and engine seed (default: 0)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 8 and 16 seqs (n=4), max_tokens 8-32")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--vllm-eager", action="store_true",
                   help="run (a) eager, as the sidecar runs vLLM on CPU (default: vLLM's own default, torch.compile)")
    p.add_argument("--no-vllm-cpu-setup", action="store_true",
                   help="run without vLLM's documented CPU set-up (tcmalloc + Intel OpenMP preloaded, threads "
                        "bound): its figures then are not its users'")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench import vllm_cpu_setup

    setup = vllm_cpu_setup.apply("bench.engines", argv, enabled=not args.no_vllm_cpu_setup)
    VllmOffline.eager = args.vllm_eager
    quick = args.quick
    args.model = args.model or ("tiny" if quick else "smollm2")
    args.dtypes = [d for d in (args.dtypes or ("float32" if quick else "float32,bfloat16")).split(",") if d]
    seqs = [int(s) for s in (args.seqs or ("8,16" if quick else "32,256")).split(",") if s]
    args.n = args.n or (4 if quick else 8)
    args.max_tokens = tuple(args.max_tokens or ((8, 32) if quick else (16, 128)))
    keys = [k for k in args.engines.split(",") if k]
    if bad := [k for k in keys if k not in ENGINES]:
        p.error(f"unknown engine {bad[0]!r}; pick from {','.join(ENGINES)}")
    if bad := [s for s in seqs if s % args.n]:
        p.error(f"--seqs {bad[0]} is not a multiple of n={args.n}")

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.vllm_kv_gib:g}")  # the vLLM sidecar inherits it
    from engine.vllm_start import apply_env_defaults

    applied = apply_env_defaults("cpu", 1, "WARNING")  # before vLLM is imported (a: here; b: the sidecar too)
    log.info("vLLM env: %s", " ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("VLLM_")))
    del applied
    from transformers import AutoConfig

    from engine.models.model_names import resolve_model_arg
    from engine.model_runner import available_cpus

    torch.set_num_threads(available_cpus())
    model_dir = resolve_model_arg(args.model)
    num_params = count_params(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    # the S-sequence workload is the first S/n prompts of the default largest one, whichever --seqs run, so
    # figures from runs in parts (--engines, --dtypes, --seqs) are of the same requests
    pool = max(seqs + [16 if quick else 256]) // args.n
    whole = make_workload(vocab, pool, args.n, tuple(args.prompt_len), args.max_tokens, args.seed)
    workloads = {s: whole.head(s // args.n) for s in seqs}
    warm = make_workload(vocab, 4, args.n, tuple(args.prompt_len), (4, 8), args.seed + 1)
    max_model_len = args.prompt_len[1] + args.max_tokens[1]
    max_num_seqs = max(seqs)
    log.info("model %s (%.1fM params), %d CPUs; workloads %s", model_dir, num_params / 1e6, available_cpus(),
             ", ".join(f"{len(w.prompts)} prompts x n={w.n} = {s} seqs, {w.useful_tokens} tokens"
                       for s, w in workloads.items()))

    from bench.read_bound import model_bytes, read_bytes

    bandwidth = max(read_bandwidth() for _ in range(3))  # and before each engine's runs: the best counts
    bounds = {}
    for dtype in args.dtypes:
        weight_bytes, kv_token = model_bytes(model_dir, num_params, getattr(torch, dtype).itemsize)
        for s, w in workloads.items():
            bounds[dtype, s] = read_bytes([len(p) for p in w.prompts], w.max_tokens, w.n, weight_bytes, kv_token)
    rows: list[Row] = []
    peaks: dict[str, float] = {}
    t_all = time.perf_counter()
    for dtype in args.dtypes:
        peaks[dtype] = probe_peak(dtype, tries=1 if dtype != "float32" else 3)
        for key in keys:
            torch.set_num_threads(available_cpus())  # whatever ran before in this process
            got = run_engine(key, dtype, model_dir, workloads, warm, max_num_seqs, max_model_len, args.seed,
                             args.repeats)
            rows += got
            peaks[dtype] = max([peaks[dtype]] + [r.probe for r in got])

    import transformers

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "not installed"
    print(f"\nengines: {os.path.basename(model_dir.rstrip('/'))} ({num_params / 1e6:.1f}M params), CPU, "
          f"{available_cpus()} threads, torch {torch.__version__}, vllm {vllm_version}, transformers "
          f"{transformers.__version__}; workload {args.n} samples per prompt, prompt len {args.prompt_len[0]}-"
          f"{args.prompt_len[1]}, max_tokens {args.max_tokens[0]}-{args.max_tokens[1]}, temperature 1, ignore_eos, "
          f"logprobs 0, no seeds; (a) {'eager' if args.vllm_eager else 'compiled (vLLM default)'}; max_num_seqs {max_num_seqs}, max_model_len {max_model_len}, "
          f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; fastest of {args.repeats} per row; "
          f"{time.perf_counter() - t_all:.0f} s in all\n{setup}")
    bandwidth = max([bandwidth] + [r.read_probe for r in rows])  # on a noisy machine the probe moves 12-22 GB/s
    active = active_params(model_dir)
    print(report(rows, peaks, active, bounds, bandwidth))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [{**r.__dict__, "tps": r.tps, "tpc": r.tpc,
                                 **dict(zip(("of_peak", "of_read"), shares(r, peaks, active, bounds, bandwidth)))}
                                for r in rows], "peaks": peaks, "params": num_params, "bandwidth": bandwidth}, f,
                      indent=2)


if __name__ == "__main__":
    main()
