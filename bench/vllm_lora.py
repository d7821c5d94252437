"""LoRA pushes into vLLM (issue 31 item 5): merged full weights against vLLM LoRA adapters.

A trainer trains a PEFT LoRA adapter (r=--lora-r, alpha 2r, on q/k/v/o/gate/up/down, fp32, the
HF model loaded from the engine's model directory). Two bare `vllm.LLM` engines in this process
(each its own engine-core process, enforce_eager, started once and warmed up):

  (a) merged   vLLM without LoRA. A push: the trainer merges (`weight_sync.trainer.lora_push.merged_weights`,
               timed), writes the full weights as one safetensors file under /dev/shm (timed: the
               stand-in for the wire; our real pushes broadcast the same bytes over gloo), and the
               engine reloads them (`llm.collective_rpc("reload_weights", weights_path=...)`: the
               worker's `model_runner.reload_weights`, vLLM's in-place reload that our
               vllm_receiver also ends in; timed from the call to its return).
  (b) adapter  vLLM with enable_lora=True, max_lora_rank=r. A push: the trainer writes the
               adapter (`save_pretrained` to a new dir under /dev/shm, timed), the engine loads
               it as a new LoRARequest(name, int_id, path) (`llm.llm_engine.add_lora`, timed) and
               drops the previous one (`remove_lora`, timed). Also timed, on other pushes: the
               lazy route, a 1-token request carrying the new LoRARequest (vLLM loads it on first
               use) minus the same request right after (adapter loaded).

Then decode throughput on an RL-shaped workload (bench.engine_throughput.make_workload: --prompts
x n=--n, temperature 1, ignore_eos, --max-tokens new tokens), interleaved over --repeats rounds:
(a) with the merged weights; (b) with the adapter active on every request; and (b) without any
LoRARequest (what enable_lora alone costs); with --split also a prefill-only pass (max_tokens=1)
of the same prompts on (a) and (b). Both engines: prefix caching off, the same per-step token
budget (--max-num-batched-tokens). Bytes per push: the full weights' file against the
adapter's file. A greedy check: (b) with the adapter against (a) merged on a few prompts.

    .venv-vllm/bin/python -m bench.vllm_lora                   # SmolLM2-135M fp32, 5 pushes each, 3 rounds
    .venv-vllm/bin/python -m bench.vllm_lora --quick           # tiny model, 2 pushes, 1 round
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time

log = logging.getLogger("bench.vllm_lora")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(model_dir: str, r: int, seed: int):
    """The trainer's model: fp32 HF model + PEFT LoRA, B moved off zero so the adapter matters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGET_MODULES,
                                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    train_step(model, torch.Generator().manual_seed(seed), scale=0.02)
    return model


def train_step(model, gen, scale: float = 1e-3) -> None:
    """Move every LoRA factor a little, in place, as an optimizer step does."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def make_llm(model_dir: str, lora_r: int | None, max_seqs: int, max_len: int, max_batched: int):
    from vllm import LLM

    kw = dict(enable_lora=True, max_lora_rank=lora_r, max_loras=1, max_cpu_loras=2) if lora_r else {}
    return LLM(model=model_dir, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, seed=0,
               max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=max_batched,
               enable_prefix_caching=False, disable_log_stats=True, **kw)


def prompts_of(token_lists):
    return [{"prompt_token_ids": list(t)} for t in token_lists]


def push_merged(llm, model, root: str, k: int) -> dict:
    """(a): merge on the trainer, write the full weights, vLLM reloads them in place."""
    from safetensors.torch import save_file

    from weight_sync.trainer.lora_push import merged_weights

    t0 = time.perf_counter()
    named = merged_weights(model)
    t1 = time.perf_counter()
    path = os.path.join(root, f"merged-{k}")
    os.makedirs(path)
    save_file({n: t.contiguous() for n, t in named}, os.path.join(path, "model.safetensors"))
    t2 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})
    t3 = time.perf_counter()
    nbytes = dir_bytes(path)
    old = os.path.join(root, f"merged-{k - 1}")
    if os.path.isdir(old):
        shutil.rmtree(old)
    return {"trainer_s": t1 - t0, "write_s": t2 - t1, "load_s": t3 - t2, "total_s": t3 - t0, "bytes": nbytes}


def push_adapter(llm, model, root: str, k: int, lazy: bool, probe, probe_params) -> tuple[dict, object]:
    """(b): write the adapter, vLLM loads it as a new LoRARequest and drops the previous one."""
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    path = os.path.join(root, f"adapter-{k}")
    model.save_pretrained(path)
    t1 = time.perf_counter()
    req = LoRARequest(f"v{k}", k, path)
    if lazy:  # first request with it loads it; the same request again is the plain request's cost
        llm.generate(probe, probe_params, lora_request=req, use_tqdm=False)
        t2 = time.perf_counter()
        llm.generate(probe, probe_params, lora_request=req, use_tqdm=False)
        t3 = time.perf_counter()
        load_s = (t2 - t1) - (t3 - t2)
    else:
        assert llm.llm_engine.add_lora(req), "add_lora returned False"
        load_s = time.perf_counter() - t1
    t4 = time.perf_counter()
    if k > 1:
        llm.llm_engine.remove_lora(k - 1)
        shutil.rmtree(os.path.join(root, f"adapter-{k - 1}"), ignore_errors=True)
    remove_s = time.perf_counter() - t4
    loaded = sorted(llm.llm_engine.list_loras())
    assert loaded == [k], f"loaded adapters {loaded}, wanted [{k}]"
    return ({"trainer_s": 0.0, "write_s": t1 - t0, "load_s": load_s, "remove_s": remove_s,
             "total_s": t1 - t0 + load_s + remove_s, "bytes": dir_bytes(path), "lazy": lazy}, req)


def decode(llm, prompts, params, lora_request=None) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
    s = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens / s, tokens, s


def med(rows, key):
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> None:
    from engine.models.model_names import MODEL_HELP

    p = argparse.ArgumentParser(prog="python -m bench.vllm_lora", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: smollm2; tiny with --quick)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2r; default 16)")
    p.add_argument("--pushes", type=int, default=None, help="timed pushes per route (default 5; --quick 2); "
                   "(b) times as many again through the lazy route")
    p.add_argument("--prompts", type=int, default=None, help="prompts per decode batch (default 16; --quick 8)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per sample (default 64; --quick 16)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"),
                   help="prompt lengths in tokens (default 16 128)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved decode rounds (default 3; --quick 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="vLLM's token budget per step, both engines (default 512; vLLM's CPU default, 4096, "
                   "made one LoRA prefill step outlast the 300 s execute_model timeout here)")
    p.add_argument("--split", action="store_true",
                   help="also time a prefill-only pass (max_tokens=1) per engine and round: the decode phase's "
                        "tok/s = tokens / (full - prefill-only)")
    p.add_argument("--shm", default="/dev/shm", help="where pushes write their files (default /dev/shm)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 pushes, 8 prompts, 1 round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-vllm-cpu-setup", action="store_true",
                   help="run without vLLM's documented CPU set-up (bench/vllm_cpu_setup.py): its figures then are "
                        "not its users'")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    q = args.quick
    pushes = args.pushes or (2 if q else 5)
    num_prompts = args.prompts or (8 if q else 16)
    max_tokens = args.max_tokens or (16 if q else 64)
    repeats = args.repeats or (1 if q else 3)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench import vllm_cpu_setup

    setup = vllm_cpu_setup.apply("bench.vllm_lora", argv, enabled=not args.no_vllm_cpu_setup)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")  # a LoRA step on a busy CPU can be slow  # 128 sequences of ~200 tokens of smollm2 need ~1.2 GB
    from engine.vllm_start import apply_env_defaults

    apply_env_defaults("cpu", 1, "WARNING")
    import torch
    from transformers import AutoConfig
    from vllm import SamplingParams

    from bench.engine_throughput import make_workload
    from engine.models.model_names import resolve_model_arg
    from engine.model_runner import available_cpus

    torch.set_num_threads(available_cpus())
    model_dir = resolve_model_arg(args.model or ("tiny" if q else "smollm2"))
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    wl = make_workload(vocab, num_prompts, args.n, tuple(args.prompt_len), (max_tokens, max_tokens), args.seed)
    warm = make_workload(vocab, 4, args.n, tuple(args.prompt_len), (8, 8), args.seed + 1)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    warm_params = SamplingParams(n=args.n, temperature=1.0, max_tokens=8, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    probe_params = SamplingParams(temperature=0.0, max_tokens=1)
    prompts, warm_prompts = prompts_of(wl.prompts), prompts_of(warm.prompts)
    probe = prompts_of(wl.prompts[:1])
    check = prompts_of(wl.prompts[:4])
    max_len = args.prompt_len[1] + max(max_tokens, 16) + 16

    trainer = peft_model(model_dir, args.lora_r, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    nparams = sum(p.numel() for p in trainer.get_base_model().parameters())
    log.info("model %s (%.1fM params, fp32), LoRA r=%d alpha=%d on %s; workload %d prompts x n=%d x %d tokens",
             model_dir, nparams / 1e6, args.lora_r, 2 * args.lora_r, ",".join(TARGET_MODULES), num_prompts,
             args.n, max_tokens)
    root = tempfile.mkdtemp(prefix="vllm_lora-", dir=args.shm)
    try:
        t0 = time.perf_counter()
        llm_a = make_llm(model_dir, None, num_prompts * args.n, max_len, args.max_num_batched_tokens)
        log.info("(a) engine up in %.1f s", time.perf_counter() - t0)
        t0 = time.perf_counter()
        try:
            llm_b = make_llm(model_dir, args.lora_r, num_prompts * args.n, max_len,
                             args.max_num_batched_tokens)
        except Exception as e:  # noqa: BLE001 - the answer, if vLLM's CPU build refuses LoRA
            log.error("vLLM with enable_lora=True did not start: %s: %s", type(e).__name__, e)
            raise
        log.info("(b) engine up in %.1f s", time.perf_counter() - t0)
        base_greedy = [o.outputs[0].token_ids for o in llm_a.generate(check, greedy, use_tqdm=False)]
        for llm in (llm_a, llm_b):
            llm.generate(warm_prompts, warm_params, use_tqdm=False)

        # pushes: one untimed warm-up push each, then the timed ones
        rows_a, rows_b = [], []
        k_a = k_b = 0
        req = None
        for i in range(pushes + 1):
            train_step(trainer, gen)
            k_a += 1
            r = push_merged(llm_a, trainer, root, k_a)
            log.info("(a) push %d: merge %.3f s, write %.3f s, reload %.3f s, total %.3f s, %.1f MB", k_a,
                     r["trainer_s"], r["write_s"], r["load_s"], r["total_s"], r["bytes"] / 1e6)
            if i:
                rows_a.append(r)
            for lazy in (False, True):
                k_b += 1
                r, req = push_adapter(llm_b, trainer, root, k_b, lazy, probe, probe_params)
                log.info("(b) push %d (%s): save_pretrained %.3f s, load %.3f s, remove %.3f s, total %.3f s, "
                         "%.2f MB", k_b, "lazy" if lazy else "add_lora", r["write_s"], r["load_s"], r["remove_s"],
                         r["total_s"], r["bytes"] / 1e6)
                if i:
                    rows_b.append(r)
        # the engines now hold the same adapter: (a) merged, (b) as the LoRA `req`
        a_greedy = [o.outputs[0].token_ids for o in llm_a.generate(check, greedy, use_tqdm=False)]
        b_greedy = [o.outputs[0].token_ids for o in llm_b.generate(check, greedy, lora_request=req,
                                                                   use_tqdm=False)]
        same = sum(x == y for a, b in zip(a_greedy, b_greedy) for x, y in zip(a, b))
        moved = sum(x != y for a, b in zip(a_greedy, base_greedy) for x, y in zip(a, b))
        total = sum(len(a) for a in a_greedy)
        log.info("greedy check: (b) adapter = (a) merged on %d/%d tokens; (a) merged differs from the base on %d",
                 same, total, moved)

        # decode throughput, interleaved rounds
        for llm, lr in ((llm_a, None), (llm_b, req), (llm_b, None)):
            llm.generate(warm_prompts, warm_params, lora_request=lr, use_tqdm=False)
        tput = {"a": [], "b": [], "b0": []}
        phase = {"a": [], "b": []}  # (prefill-only s, decode-phase tok/s)
        prefill_params = SamplingParams(n=args.n, temperature=1.0, max_tokens=1, ignore_eos=True)
        for rnd in range(repeats):
            for key, llm, lr in (("a", llm_a, None), ("b", llm_b, req), ("b0", llm_b, None)):
                time.sleep(1.5)  # the other engine's worker spins (sched_yield) for 1 s after its last step
                tps, tokens, s = decode(llm, prompts, params, lr)
                tput[key].append(tps)
                log.info("round %d %s: %d tokens in %.2f s, %.1f tok/s", rnd, key, tokens, s, tps)
                if args.split and key in phase:
                    time.sleep(1.5)
                    t0 = time.perf_counter()
                    llm.generate(prompts, prefill_params, lora_request=lr, use_tqdm=False)
                    pf = time.perf_counter() - t0
                    ntok = len(prompts) * args.n * (max_tokens - 1)
                    phase[key].append((pf, ntok / max(s - pf, 1e-9)))
                    log.info("round %d %s prefill-only: %.2f s (%.1f prompt tok/s); decode phase ~%.1f tok/s", rnd,
                             key, pf, args.n * sum(map(len, wl.prompts)) / pf, phase[key][-1][1])
        ratio_b = statistics.median(b / a for a, b in zip(tput["a"], tput["b"]))
        ratio_b0 = statistics.median(b / a for a, b in zip(tput["a"], tput["b0"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    add = [r for r in rows_b if not r["lazy"]]
    lazy = [r for r in rows_b if r["lazy"]]
    lines = [
        f"model {os.path.basename(model_dir.rstrip('/'))} ({nparams / 1e6:.1f}M, fp32), LoRA r={args.lora_r}; "
        f"{len(rows_a)} timed pushes per route (medians), {repeats} decode rounds of {num_prompts} x n={args.n} "
        f"x {max_tokens} tokens",
        "",
        f"{'':<34} {'(a) merged':>12} {'(b) LoRA':>12} {'(b)/(a)':>8}",
        f"{'bytes per push (MB)':<34} {med(rows_a, 'bytes') / 1e6:>12.1f} {med(add, 'bytes') / 1e6:>12.2f} "
        f"{med(add, 'bytes') / med(rows_a, 'bytes'):>8.4f}",
        f"{'trainer: merge s':<34} {med(rows_a, 'trainer_s'):>12.3f} {'-':>12}",
        f"{'trainer: write to shm s':<34} {med(rows_a, 'write_s'):>12.3f} {med(add, 'write_s'):>12.3f}",
        f"{'engine: load s (reload/add_lora)':<34} {med(rows_a, 'load_s'):>12.3f} {med(add, 'load_s'):>12.3f}",
        f"{'engine: remove old adapter s':<34} {'-':>12} {med(add, 'remove_s'):>12.3f}",
        f"{'per-push total s':<34} {med(rows_a, 'total_s'):>12.3f} {med(add, 'total_s'):>12.3f} "
        f"{med(add, 'total_s') / med(rows_a, 'total_s'):>8.3f}",
        f"{'  (b) lazy: load in 1st request s':<34} {'':>12} {med(lazy, 'load_s'):>12.3f}",
        f"{'  (b) lazy: per-push total s':<34} {'':>12} {med(lazy, 'total_s'):>12.3f} "
        f"{med(lazy, 'total_s') / med(rows_a, 'total_s'):>8.3f}",
        f"{'decode tok/s, adapter active':<34} {statistics.median(tput['a']):>12.1f} "
        f"{statistics.median(tput['b']):>12.1f} {ratio_b:>8.3f}",
        f"{'decode tok/s, (b) no LoRARequest':<34} {'':>12} {statistics.median(tput['b0']):>12.1f} "
        f"{ratio_b0:>8.3f}",
    ]
    if args.split:
        pf = {k: statistics.median(x[0] for x in v) for k, v in phase.items()}
        dtps = {k: statistics.median(x[1] for x in v) for k, v in phase.items()}
        lines += [
            f"{'prefill-only pass s':<34} {pf['a']:>12.2f} {pf['b']:>12.2f} {pf['b'] / pf['a']:>8.3f}",
            f"{'decode phase tok/s (full - prefill)':<34} {dtps['a']:>12.1f} {dtps['b']:>12.1f} "
            f"{dtps['b'] / dtps['a']:>8.3f}",
        ]
    lines += [
        "",
        f"greedy: (b) = (a) on {same}/{total} tokens ((a) differs from the base on {moved}); ratios are medians "
        "of per-round ratios",
        setup,
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
