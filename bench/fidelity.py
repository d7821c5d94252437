"""How far each engine's policy is from the trainer's (issue 49 item 4): the recipes' arithmetic prompts,
sampled at temperature 1 from fp32, bf16 (with its LM head in bf16, and in fp32) and int8 engines (the
int8 one as the engine serves it: weight-only on AMX, or as integers on AVX512-VNNI or AVX2, its lm_head
in full precision; with the lm_head quantized too; and W8A8, activations per token, the scheme of CPUs
with none), and
every sampled token scored again by the trainer (transformers' model, fp32). The figure is the share of
sampled tokens whose trainer/engine probability ratio lies outside [0.9, 1.1] (what truncated
importance sampling has to correct), with the mean and largest |log ratio|. On a mixture of experts
every sample carries its routed experts, and each engine gets a second row: the same tokens scored with
the trainer's routers replaying the engine's experts (recipes/routing_replay.py), beside the share of
tokens whose routing differs from the engine's in some layer without replay. On a dense model each
engine gets an "exact" row too: the same tokens scored as `--on-policy exact` scores them
(engine/exact_logprobs.py, the engine's arithmetic in the trainer's process, given the trainer's
weights), which must be 0 throughout.

    python -m bench.fidelity                                 # smollm2, 32 prompts x 4, 64 tokens
    python -m bench.fidelity --prompts 8 --max-tokens 32     # quicker
    python -m bench.fidelity --engines fp32 --ablation       # which int8 rounding moves the policy
    python -m bench.fidelity --model <qwen3-moe-2core dir> --engines bf16   # with and without routing replay
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

log = logging.getLogger("bench.fidelity")

ENGINES = {  # name -> (dtype, quantization, int8 lm_head quantized too, int8 activations too, head dtype)
    "fp32": ("float32", "none", False, False, "auto"),
    "bf16": ("bfloat16", "none", False, False, "auto"),
    "bf16+fp32head": ("bfloat16", "none", False, False, "float32"),  # the LM head in fp32 (engine/kernels/fp32_head.py)
    "int8": ("float32", "int8", False, False, "auto"),  # the engine's int8: weight-only (AMX; or integers)
    "int8+lm_head": ("float32", "int8", True, False, "auto"),
    "w8a8": ("float32", "int8", False, True, "auto"),  # activations quantized per token as well
}


def engine_config(model_dir: str, name: str, seed: int = 0):
    from engine import EngineConfig

    dtype, quantization, _, _, head_dtype = ENGINES[name]
    return EngineConfig(model=model_dir, dtype=dtype, quantization=quantization, max_model_len=1024, seed=seed,
                        head_dtype=head_dtype)


def exact_mismatch(trainer, model_dir: str, name: str, samples: list[tuple]) -> dict:
    """`mismatch` of the samples scored as --on-policy exact scores them: engine `name`'s arithmetic in this
    process, loaded with the trainer's weights."""
    from engine.exact_logprobs import ExactLogprobs

    scorer = ExactLogprobs(engine_config(model_dir, name))
    scorer.load_weights((n, p.detach()) for n, p in trainer.named_parameters())
    kept = [s for s in samples if s[1]]
    t0 = time.perf_counter()
    scored = scorer.logprobs([list(p) for p, *_ in kept], [list(c) for _, c, *_ in kept], 1.0)
    log.info("%s exact: %d tokens scored in %.1f s", name, sum(map(len, scored)), time.perf_counter() - t0)
    return mismatch(None, [(p, c, lp, None) for p, c, lp, _ in kept], scored=scored)

EXACT = ("fp32", "bf16", "bf16+fp32head", "int8")  # the engines --on-policy exact serves (their own kernels)


def sample(model_dir: str, prompts: list, name: str, n: int, max_tokens: int, seed: int, moe: bool = False
           ) -> list[tuple]:
    """(prompt ids, completion ids, the engine's logprobs, its routed experts or None) per sample of
    engine `name`."""
    from engine import LLM, SamplingParams
    from engine.kernels import int8_linears

    _, quantization, lm_head, activations, _ = ENGINES[name]
    keep = int8_linears.KEEP_FULL_PRECISION
    int8_linears.KEEP_FULL_PRECISION = () if lm_head else keep  # both read when the engine loads
    os.environ[int8_linears.ENV_ACTIVATIONS] = "int8" if activations else "bf16"
    try:
        llm = LLM(engine_config(model_dir, name, seed))
        if quantization == "int8":
            log.info("%s: int8 kernel %s", name, int8_linears.kernel())
    finally:
        int8_linears.KEEP_FULL_PRECISION = keep
        del os.environ[int8_linears.ENV_ACTIVATIONS]
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed, return_routed_experts=moe)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    log.info("%s: %d tokens sampled in %.1f s", name, tokens, time.perf_counter() - t0)
    return [(o.prompt_token_ids, c.token_ids, c.logprobs, c.routed_experts) for o in outs for c in o.outputs]


@torch.inference_mode()
def trainer_logprobs(trainer, prompt_ids: list[int], completion: list[int], routed=None) -> torch.Tensor:
    """The fp32 trainer's log-probabilities of `completion` after `prompt_ids` (routed: the engine's
    experts, replayed)."""
    import contextlib

    from recipes.routing_replay import align, replay

    ids = torch.tensor([prompt_ids + completion])
    ctx = contextlib.nullcontext()
    if routed is not None:
        routes, mask = align(routed, 0, ids.shape[1])
        ctx = replay(trainer, routes[None], mask[None])
    with ctx:
        logits = trainer(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def mismatch(trainer, samples: list[tuple], replayed: bool = False, scored: list | None = None) -> dict:
    """Share of tokens with trainer/engine probability ratio outside [0.9, 1.1], mean and max |log ratio|;
    with routed experts, the share of routed tokens the trainer routes otherwise in some layer. `scored`:
    the trainer's logprobs of each sample given (no trainer forward then)."""
    from recipes import corrections as C
    from recipes.routing_replay import align, own_routing, routing_mismatch

    logs, differ, routed_tokens = [], 0.0, 0
    for k, (prompt_ids, completion, engine_lp, routed) in enumerate(samples):
        if completion:
            lp = scored[k] if scored is not None else trainer_logprobs(trainer, list(prompt_ids), list(completion),
                                                                       routed if replayed else None)
            logs.append(lp - torch.tensor(engine_lp))
            if routed is not None and not replayed:
                seq = torch.tensor([list(prompt_ids) + list(completion)])
                routes, mask = align(routed, 0, seq.shape[1])
                differ += routing_mismatch(own_routing(trainer, seq)[0], routes, mask) * int(mask.sum())
                routed_tokens += int(mask.sum())
    log_ratio = torch.cat(logs)
    m = C.mismatch(log_ratio[None], torch.ones(1, log_ratio.numel()))  # the recipes' per-step measures
    return {"tokens": log_ratio.numel(), "differ": int((log_ratio != 0).sum()), "outside": m["outside_band"],
            "mean_abs_log": log_ratio.abs().mean().item(),
            "max_abs_log": m["max_abs_log_ratio"], "k3_kl": m["k3_kl"], "chi2": m["chi2_token"],
            "routing": differ / routed_tokens if routed_tokens else (0.0 if replayed else None)}


def hadamard_rotation(k: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal [k, k]: random signs times a block-diagonal Hadamard matrix, its blocks the largest power
    of two dividing k (QuaRot's rotation, which spreads an outlier over its block before rounding). Pure."""
    block = k & -k
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (k,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return signs[:, None] * torch.block_diag(*[h / block**0.5] * (k // block))


def fake_quantized(trainer, weights: bool, activations: bool, group: int | None = None, rotate: bool = False):
    """A copy of the trainer with int8 rounding simulated in fp32 (every linear but the lm_head):
    its weights rounded per output channel (`weights`), its linears' inputs per token
    (`activations`), or each per `group` values of K (a scale per group: what a kernel multiplying
    int8 by int8 with group scales would do): which of the two moves the policy. `rotate`: each linear's
    K turned by `hadamard_rotation` first (x R and W R, the same product unrounded), then rounded."""
    import copy

    from engine.kernels.int8_linears import quantize_groups, quantize_rows, quantize_weight

    def grouped(x: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_groups(x, group)
        return q.float() * scale.float().repeat_interleave(group, dim=1)[:, :x.shape[1]]

    def rounded_weight(w: torch.Tensor) -> torch.Tensor:
        if group:
            return grouped(w)
        q, scale = quantize_weight(w)
        return q.float() * scale[:, None]

    def rounded_input(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        if rotate:
            x = x @ module.rotation
        if not activations:
            return (x.reshape(args[0].shape),)
        if group:
            return (grouped(x).reshape(args[0].shape),)
        q, scale = quantize_rows(x)
        return ((q.float() * scale).reshape(args[0].shape),)

    model = copy.deepcopy(trainer)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        w = module.weight.detach()
        if rotate:
            module.rotation = hadamard_rotation(w.shape[1])
            w = w @ module.rotation
        module.weight = torch.nn.Parameter(rounded_weight(w) if weights else w, requires_grad=False)
        if activations or rotate:
            module.register_forward_pre_hook(rounded_input)
    return model


ABLATIONS = {  # row -> (weights, activations, group[, rotate]): per channel / per token, then per 32 or 16 of K
    "fake W8": (True, False, None), "fake A8": (False, True, None), "fake W8A8": (True, True, None),
    "fake W8 g32": (True, False, 32), "fake A8 g32": (False, True, 32), "fake W8A8 g32": (True, True, 32),
    "fake W8 g16": (True, False, 16),  # the engine's weight-only int8 (amx_linears.W8_GROUP)
    "fake A8 g16": (False, True, 16), "fake W8A8 g16": (True, True, 16),
    # int8 x int8 (VPDPBUSD: 2x VDPBF16PS's products, bench/dot_rates.py) with outliers spread first
    "rotated W8 g16": (True, False, 16, True), "rotated A8 g16": (False, True, 16, True),
    "rotated W8A8 g16": (True, True, 16, True), "rotated W8A8 g32": (True, True, 32, True),
}


def ablation(trainer, samples: list[tuple]) -> dict:
    """The fp32 engine's samples scored by fake-quantized trainers (ABLATIONS) against the trainer."""
    exact = [(p, c, trainer_logprobs(trainer, list(p), list(c)).tolist(), None) for p, c, _, _ in samples if c]
    return {name: mismatch(fake_quantized(trainer, *how), exact) for name, how in ABLATIONS.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or directory (default smollm2)")
    ap.add_argument("--prompts", type=int, default=32, help="arithmetic prompts")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--level", type=int, default=1, help="the arithmetic task's level (recipes/arithmetic.py)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {list(ENGINES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ablation", action="store_true",
                    help="also score the fp32 engine's samples with the trainer's weights and/or linear inputs "
                         "rounded to int8 in fp32 (which rounding moves the policy)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers import AutoModelForCausalLM

    from engine.models.model_names import resolve_model_arg
    from engine.tokenizer import load_tokenizer
    from recipes.tasks import ArithmeticTask

    model_dir = resolve_model_arg(args.model)
    task = ArithmeticTask(load_tokenizer(model_dir), level=args.level, seed=args.seed)
    prompts = [item["prompt"] for item in task.prompts(args.prompts)]
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    log.info("%s, arithmetic level %d: %d prompts x %d samples, up to %d tokens, temperature 1; trainer: "
             "transformers fp32", args.model, args.level, args.prompts, args.n, args.max_tokens)
    from recipes.routing_replay import routers

    moe = bool(routers(trainer))
    rows = {}
    for name in args.engines.split(","):
        samples = sample(model_dir, prompts, name, args.n, args.max_tokens, args.seed, moe)
        rows[name] = mismatch(trainer, samples)
        if moe:
            rows[f"{name} replay"] = mismatch(trainer, samples, replayed=True)
        elif name in EXACT:
            rows[f"{name} exact"] = exact_mismatch(trainer, model_dir, name, samples)
        if args.ablation and name == "fp32":
            ablated = ablation(trainer, samples)
    if args.ablation:
        rows.update(ablated)
    log.info("%-20s %7s %12s %22s %14s %13s %10s %10s %s", "engine", "tokens", "bits differ", "ratio outside [0.9,1.1]",
             "mean|log r|", "max|log r|", "k3 KL", "chi2", "routing differs" if moe else "")
    for name, r in rows.items():
        routing = "" if r.get("routing") is None else f"{100 * r['routing']:.2f}%"
        log.info("%-20s %7d %12d %22.2f%% %14.4f %13.3g %10.2e %10.2e %s", name, r["tokens"], r["differ"],
                 100 * r["outside"], r["mean_abs_log"], r["max_abs_log"], r["k3_kl"], r["chi2"], routing)


if __name__ == "__main__":
    main()
