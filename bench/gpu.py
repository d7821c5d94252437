"""The GPU check anyone can run on a CUDA machine, side by side in one run:

  1. engine (`LLM`) vs HF `generate` tok/s on the same GPU, RL-shaped workload (P prompts x n
     samples, temperature 1, EOS ignored), in bf16; the engine's FLOPs/s as a fraction of the
     bf16 matmul peak this run probes;
  2. the engine-vs-trainer logprob mismatch in that dtype: the share of sampled tokens whose
     ratio exp(engine logprob - trainer logprob) falls outside [0.9, 1.1] (TRL reports 7.5%
     with vLLM in bf16; our goal is under 1%), with the trainer's logprobs from a plain HF forward;
  3. a colocated push (engine on the trainer's device, through weight_sync.trainer.shared_memory: CUDA IPC on a
     GPU, /dev/shm on the CPU) of the --push-size model against a plain copy of the same bytes;
  4. with two GPUs or more: a push over NCCL (trainer on cuda:0, engine on cuda:1) against a raw
     NCCL broadcast of the same bytes (bench.weight_sync on CUDA);
  5. one decode step of an eighth of the batch and of the full batch (64 and 512 samples by default):
     its wall time against the GPU's kernel time in it (torch.profiler, CUDA activity only), i.e. how
     much of the step the GPU is busy and how much is the host's (scheduling, tensors, sampling's sync).

Items 1 and 5 run twice, side by side: decode steps eager (`enforce_eager`) and on CUDA graphs
(engine/decode_graphs.py; the CPU has none, so there both rows run eagerly).

    python -m bench.gpu                        # CUDA, bf16, the small model
    python -m bench.gpu --device cpu --quick   # the same code on the CPU (fp32): a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import torch

from bench.engine_throughput import make_workload

log = logging.getLogger("bench.gpu")
TARGET_MISMATCH = 0.01


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 4096, reps: int = 20) -> float:
    """What this device's matmuls reach right now, FLOP/s (the ceiling the engine is compared to)."""
    if device.type == "cpu":
        n, reps = 1024, 5
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(model_dir: str, device: str, dtype: str, wl, max_model_len: int, enforce_eager: bool):
    """The workload through our engine: (outputs, seconds, parameters, decode steps by batch, graphs
    captured); its decode steps eager or on CUDA graphs (`enforce_eager`)."""
    from engine import LLM, EngineConfig, SamplingParams

    llm = LLM(EngineConfig(model=model_dir, device=device, dtype=dtype, max_num_seqs=len(wl.prompts) * wl.n,
                           max_model_len=max_model_len, seed=0, enforce_eager=enforce_eager))
    params = [SamplingParams(n=wl.n, temperature=1.0, max_tokens=k, ignore_eos=True) for k in wl.max_tokens]
    llm.generate(wl.prompts[:2], params[:2], use_tqdm=False)  # warm-up
    _sync(torch.device(device))
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False)
    _sync(torch.device(device))
    seconds = time.perf_counter() - t0
    num_params = sum(p.numel() for p in llm.core.runner.model.parameters())
    steps = {}
    for prompts in sorted({max(1, len(wl.prompts) // 8), len(wl.prompts)}):  # 64 and 512 samples by default
        step = decode_step_times(llm, wl, torch.device(device), prompts)
        steps[step["batch"]] = step
    graphs = llm.core.runner.decode_graphs
    captured = None if graphs is None else graphs.captures
    del llm
    return outs, seconds, num_params, steps, captured


def decode_step_times(llm, wl, device: torch.device, num_prompts: int, steps: int = 20) -> dict:
    """One decode step of the first `num_prompts` prompts' samples (x n): median wall time of `steps`
    steps (each ends with the sampled tokens' trip to the host, the step's sync), and the GPU's
    kernel time per step over `steps` more under torch.profiler (CUDA activity only; on the CPU
    there is none to read)."""
    from engine import SamplingParams

    core = llm.core
    for i, p in enumerate(wl.prompts[:num_prompts]):
        core.add_request(f"decode-timing-{i}", p, SamplingParams(n=wl.n, temperature=1.0, max_tokens=2 * steps + 8,
                                                                 ignore_eos=True))
    # prefill steps until every sample has its first token; then two warm-up decode steps
    while core.scheduler.waiting or any(s.num_output_tokens == 0 for s in core.scheduler.running):
        core.step()
    batch = len(core.scheduler.running)
    for _ in range(2):
        core.step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        walls.append(time.perf_counter() - t0)
    gpu = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    core.step()
                _sync(device)
            gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / steps
        except Exception as e:  # no CUPTI on this host: the rest of the bench still runs
            log.warning("GPU kernel time not measured: %r", e)
    core.abort_requests([f"decode-timing-{i}" for i in range(num_prompts)])
    return {"batch": batch, "wall": sorted(walls)[len(walls) // 2], "gpu": gpu}


def run_hf_generate(model, wl, device: torch.device) -> float:
    """HF `generate` on left-padded batches of all prompts (num_return_sequences=n)."""
    from transformers import GenerationConfig

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    width = max(len(p) for p in wl.prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in wl.prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in wl.prompts], device=device)
    longest = max(wl.max_tokens)
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=wl.n,
                           max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], generation_config=GenerationConfig(
            max_new_tokens=2, pad_token_id=pad))  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        _sync(device)
    return time.perf_counter() - t0


def mismatch(model, outs, device: torch.device) -> tuple[float, float, int]:
    """(share of tokens whose engine/trainer probability ratio leaves [0.9, 1.1], mean |logprob
    difference|, tokens) with the trainer's logprobs from one HF forward per completion."""
    outside, diffs = 0, []
    with torch.inference_mode():
        for o in outs:
            for c in o.outputs:
                ids = torch.tensor([o.prompt_token_ids + c.token_ids], device=device)
                logits = model(ids).logits[0, len(o.prompt_token_ids) - 1:-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0]
                d = torch.tensor(c.logprobs, device=device) - lp
                ratio = d.exp()
                outside += int(((ratio < 0.9) | (ratio > 1.1)).sum())
                diffs.append(d.abs())
    d = torch.cat(diffs)
    return outside / d.numel(), float(d.mean()), d.numel()


def colocated_push(size: str, device: torch.device, repeats: int) -> dict:
    """A push through shared memory to an engine on the trainer's own device (CUDA IPC on a GPU,
    /dev/shm on the CPU) against a plain copy of the same bytes on that device."""
    from transformers import AutoModelForCausalLM

    from engine import AsyncEngine, EngineConfig
    from engine.models.tiny_model import build_tiny_model, default_model_dir
    from weight_sync import EXTENSION, WeightSender, flatten_parameters
    from weight_sync.engine_side.engines import engines_checksums
    from weight_sync.trainer.local_engines import push_shared_to_engines

    model_dir = str(build_tiny_model(default_model_dir(size), size))
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    flat = flatten_parameters(trainer, shared=True)
    copy_dst = torch.empty_like(flat)

    async def run() -> dict:
        engine = AsyncEngine(EngineConfig(model=model_dir, device=str(device), max_num_seqs=4, max_model_len=256,
                                          kv_cache_memory_gb=0.05, gpu_memory_utilization=0.6,
                                          worker_extension_cls=EXTENSION))
        sender, pushes, copies = WeightSender(), [], []
        try:
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                copy_dst.copy_(flat)
                _sync(device)
                copied = time.perf_counter() - t0
                t0 = time.perf_counter()
                await push_shared_to_engines([engine], sender, trainer, version=i + 1)
                pushed = time.perf_counter() - t0
                if i:  # the first is a warm-up
                    pushes.append(pushed)
                    copies.append(copied)
            assert await engines_checksums([engine]) == [sender.checksum(trainer)]
        finally:
            engine.shutdown()
        return {"bytes": flat.numel(), "push": sorted(pushes)[len(pushes) // 2], "copy": sorted(copies)[len(copies) // 2]}

    return asyncio.run(run())


def nccl_push(size: str, repeats: int) -> dict | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    from bench.weight_sync import bench_model

    return asyncio.run(bench_model(size, [64], repeats, 120.0, trainer_device="cuda:0", engine_device="cuda:1"))


def main(argv: list[str] | None = None) -> None:
    from engine.models.model_names import MODEL_HELP

    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: small, ~50M; tiny with --quick)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    p.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256, help="longest completion (each request draws its own)")
    p.add_argument("--push-size", default="medium", help="engine.models.tiny_model size of the NCCL push (~500M)")
    p.add_argument("--quick", action="store_true", help="tiny model, 8 prompts x 4, short completions")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from transformers import AutoModelForCausalLM

    from engine.models.model_names import resolve_model_arg

    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    size = "tiny" if args.quick else "small"
    if args.quick:
        args.num_prompts, args.n, args.max_tokens, args.push_size = 8, 4, 32, "tiny"
    model_dir = resolve_model_arg(args.model or size)
    tdtype = getattr(torch, dtype)
    wl = make_workload(2048 if args.quick else 4096, args.num_prompts, args.n, (16, 128), (args.max_tokens // 4,
                       args.max_tokens), seed=0)
    peak = matmul_peak(device, tdtype)
    max_len = 128 + args.max_tokens + 16
    runs = {name: run_engine(model_dir, str(device), dtype, wl, max_len, eager) for name, eager in
            (("eager", True), ("graphs", False))}
    outs, _, num_params, _, _ = runs["graphs"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).to(device).eval()
    hf_s = run_hf_generate(hf, wl, device)
    share, mean_diff, tokens = mismatch(hf, outs, device)
    useful = wl.useful_tokens
    hf_tokens = wl.num_seqs * max(wl.max_tokens)  # padded to the longest: only useful ones count
    print(f"\ndevice {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {dtype}, "
          f"{num_params / 1e6:.1f}M params, {args.num_prompts} prompts x n={args.n}, {useful} useful tokens")
    for name, (_, engine_s, _, _, captured) in runs.items():
        flops = 2 * num_params * useful / engine_s
        what = "eager" if captured is None else f"{captured} graphs captured"
        print(f"  engine, {name:<7}    {useful / engine_s:>10.0f} tok/s  ({engine_s:.2f} s; {what}; {flops / 1e12:.2f} "
              f"TFLOP/s = {flops / peak:.2%} of the {peak / 1e12:.1f} TFLOP/s matmul peak probed; "
              f"{hf_s / engine_s:.2f}x HF generate)")
    print(f"  HF generate        {useful / hf_s:>10.0f} tok/s  ({hf_s:.2f} s; {hf_tokens} tokens computed)")
    print(f"  graphs / eager: {runs['eager'][1] / runs['graphs'][1]:.2f}x")
    verdict = "OK" if share < TARGET_MISMATCH else "MISS"
    print(f"  logprob mismatch engine (graphs) vs trainer forward ({dtype}): {share:.2%} of {tokens} tokens outside "
          f"ratio [0.9, 1.1] (target < {TARGET_MISMATCH:.0%}) {verdict}; mean |diff| {mean_diff:.2e}")
    for name, (_, _, _, steps, _) in runs.items():
        for batch, step in sorted(steps.items()):
            head = f"  decode step of {batch} samples, {name}:"
            if step["gpu"] is None:
                print(f"{head} {step['wall'] * 1e3:.1f} ms wall (GPU kernel time: CUDA only)")
            else:
                host = max(step["wall"] - step["gpu"], 0)
                print(f"{head} {step['wall'] * 1e3:.2f} ms wall, GPU kernels {step['gpu'] * 1e3:.2f} ms "
                      f"({step['gpu'] / step['wall']:.0%} busy), host-only {host * 1e3:.2f} ms")
    co = colocated_push(args.push_size, device, 2 if args.quick else 10)
    kind = "CUDA IPC" if device.type == "cuda" else "/dev/shm"
    print(f"  colocated push ({kind}) of {co['bytes'] / 1e6:.0f} MB: {co['push'] * 1e3:.1f} ms vs a plain copy of the "
          f"same bytes on the device {co['copy'] * 1e3:.1f} ms: {co['copy'] / co['push']:.2f} of the copy's speed")
    push = nccl_push(args.push_size, 1 if args.quick else 10)
    if push is None:
        print("  NCCL push: needs two GPUs (one NCCL group cannot hold two ranks on one GPU)")
    else:
        key = next(iter(push["ratio"]))
        print(f"  NCCL push of {push['bytes'] / 1e6:.0f} MB: {push['ours'][key]:.3f} s vs raw NCCL broadcast "
              f"{push['raw']:.3f} s: {push['ratio'][key]:.2f} of the raw link "
              f"({push['bytes'] / push['raw'] / 1e9:.1f} GB/s raw)")


if __name__ == "__main__":
    main()
