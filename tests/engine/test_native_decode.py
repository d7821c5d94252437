"""The C decode-attention kernel (engine/kernels/native/paged_decode.c): against float64 attention within a
bound derived from the arithmetic, in the engine against HF's greedy output with it and without
it, and the torch path taken when no compiler can build it."""

import logging

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import native_decode, native_kernels
from engine.kernels.native_decode import NativeDecode
from tests.engine.helpers import hf_greedy, random_prompts

U32 = 2.0**-24  # fp32's unit roundoff


def _gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def _case(dtype, rows=37, heads=9, kv_heads=3, d=64, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 200, (rows,), generator=g)
    lengths[0], lengths[1] = 1, bs  # a single key; a row ending on a block's edge
    need = [(int(n) + bs - 1) // bs for n in lengths]
    blocks = torch.randperm(sum(need) + 5, generator=g)  # scattered over the cache, as a block manager leaves them
    table = torch.zeros(rows, max(need) + 2, dtype=torch.int64)  # wider than needed: stride != blocks used
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = blocks[at : at + n]
        at += n
    k = (torch.randn(sum(need) + 5, bs, kv_heads, d, generator=g) * 2).to(dtype)
    v = torch.randn(sum(need) + 5, bs, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(rows, heads, d, generator=g).to(dtype)
    return q, k, v, NativeDecode(table, lengths, int(lengths.max()))


def _reference(q, k, v, nd, scale, window=None):
    """float64 attention of each row over its keys (its last `window` under a sliding window), and the
    fp32 kernel's error bound per row."""
    rows, heads, d = q.shape
    kvh, bs = k.shape[2], k.shape[1]
    outs, bounds = [], []
    for r in range(rows):
        n = int(nd.lengths[r])
        first = max(0, n - window) if window else 0
        blocks = nd.block_table[r, : (n + bs - 1) // bs]
        kk = k[blocks].flatten(0, 1)[first:n].double()  # [n - first, kvh, d]
        vv = v[blocks].flatten(0, 1)[first:n].double()
        n -= first
        qq = q[r].double().view(kvh, heads // kvh, d)
        s = torch.einsum("hgd,nhd->hgn", qq, kk) * scale
        out = torch.einsum("hgn,nhd->hgd", s.softmax(-1), vv).reshape(heads, d)
        # a score's dot product errs by at most gamma_d * sum|q k| (and q * scale by one rounding); a
        # probability then by about twice the worst score error plus exp's, the sum's (gamma_n) and
        # the division's roundings; the output by that times max|v|, plus gamma_n of its own sum
        ds = (_gamma(d) + U32) * scale * torch.einsum("hgd,nhd->hgn", qq.abs(), kk.abs()).max().item()
        bounds.append(vv.abs().max().item() * (2 * ds + 4 * U32 + 2 * _gamma(n + 1)))
        outs.append(out)
    return torch.stack(outs), torch.tensor(bounds, dtype=torch.float64)


def _with_output_rounding(bound, ref, dtype, v):
    """A bf16 output is the fp32 result rounded once: at most half an ulp more, 2^-8 relative; and where
    the CPU has AVX512-BF16 (bf16_pairs.h) each weight is two bf16 halves, within 2^-18 of it: the
    weighted sum within 2^-18 max|v| more."""
    if dtype != torch.bfloat16:
        return bound
    return bound + ref.abs().amax(dim=(1, 2)) * 2.0**-8 + v.abs().max().item() * 2.0**-18


@pytest.fixture(scope="module")
def kernel_ready():
    if not native_decode.available(torch.float32, torch.device("cpu"), 9, 3, 64):
        pytest.skip("no C compiler here: the engine runs its torch path (tested by the rest of the suite)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 8, 32), (16, 2, 128), (4, 2, 16), (6, 6, 96)])  # SmolLM2; MHA;
# wide groups; Phi-3-mini's head size
def test_kernel_matches_float64_attention_within_its_rounding(kernel_ready, dtype, shape):
    heads, kv_heads, d = shape
    assert native_decode.available(dtype, torch.device("cpu"), heads, kv_heads, d)
    q, k, v, nd = _case(dtype, heads=heads, kv_heads=kv_heads, d=d)
    scale = d**-0.5
    got = native_decode.attend(nd, q, k, v, scale)
    ref, bound = _reference(q, k, v, nd, scale)
    err = (got.double() - ref).abs().amax(dim=(1, 2))
    bound = _with_output_rounding(bound, ref, dtype, v)
    assert (err <= bound).all(), f"rows over their bound: {(err / bound).max().item():.2f}x"
    assert err.max().item() > 0 or dtype == torch.float32  # bf16 rounds: a kernel that returned ref would be odd
    # a single key: the output is that key's value, exactly
    assert torch.equal(got[0].view(kv_heads, -1, d), v[nd.block_table[0, 0], 0].unsqueeze(1).expand(-1, heads // kv_heads, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64), (16, 8, 128)])  # SmolLM2's heads, Qwen3's
def test_rows_sharing_prompt_blocks_get_the_bits_each_gets_alone(kernel_ready, dtype, shape):
    """GRPO's n samples of a prompt share its cache blocks and go to one thread as a run (cut at 8
    rows), which finds the blocks they share in its L2 after the first row: 20 siblings of one prompt,
    3 of another, 5 that share two blocks of which some read only part of the second, then rows of
    their own. Each row's output must be what the kernel gives that row alone, bit for bit: the run
    changes who reads, not the sums."""
    g = torch.Generator().manual_seed(3)
    bs, (heads, kvh, d) = 16, shape
    tables, lengths, next_block = [], [], 7  # blocks 0-6: the prompts' shared blocks
    for shared, siblings in (([0, 1, 2], 20), ([3, 4], 3), ([5, 6], 5), ([], 6)):
        for i in range(siblings):
            own = int(torch.randint(1, 3, (1,), generator=g))
            if shared == [5, 6] and i % 2:  # the second shared block only in part: no block of its own
                tables.append(shared)
                lengths.append(bs + int(torch.randint(1, bs, (1,), generator=g)))
                continue
            tables.append(shared + list(range(next_block, next_block + own)))
            lengths.append(len(shared) * bs + (own - 1) * bs + int(torch.randint(1, bs + 1, (1,), generator=g)))
            next_block += own
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int64)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t)
    lens = torch.tensor(lengths)
    k = torch.randn(next_block, bs, kvh, d, generator=g).to(dtype)
    v = torch.randn(next_block, bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(len(tables), heads, d, generator=g).to(dtype)
    nd = NativeDecode(table, lens, int(lens.max()))
    got = native_decode.attend(nd, q, k, v, d**-0.5)
    for r in range(len(tables)):
        alone = native_decode.attend(NativeDecode(table[r : r + 1], lens[r : r + 1], int(lens[r])), q[r : r + 1], k, v,
                                     d**-0.5)
        assert torch.equal(got[r], alone[0]), f"row {r}"
    ref, bound = _reference(q, k, v, nd, d**-0.5)
    assert ((got.double() - ref).abs().amax(dim=(1, 2)) <= _with_output_rounding(bound, ref, dtype, v)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 8, 128), (9, 3, 64), (6, 6, 96), (4, 2, 16)])  # Qwen3; SmolLM2; Phi-3; 16
def test_a_prompts_rows_taken_together_get_the_bits_each_gets_alone(kernel_ready, dtype, shape):
    """A prefill's rows (keys 1..T of one prompt, one table) go to a thread eight at a time, which reads
    their whole blocks once for all of them (paged_decode.c's tiles: bf16_pairs.h's passes where the CPU
    multiplies bf16 pairs, the fp32 passes four slots at a time for each row in turn elsewhere):
    a 45-token prompt whose rows are cut at 8, then 13 rows of a chunk after a 37-token cached prefix,
    with bs = 8 (whole blocks of 2 pairs of pairs) and bs = 16. Each row's output must be what it gets
    alone, bit for bit, and within float64 attention's bound."""
    g = torch.Generator().manual_seed(5)
    heads, kvh, d = shape
    for bs in (8, 16):
        prompt, prefix, chunk = 45, 37, 13
        need_a, need_b = -(-prompt // bs), -(-(prefix + chunk) // bs)
        blocks = torch.randperm(need_a + need_b + 3, generator=g)
        table_a, table_b = blocks[:need_a], blocks[need_a : need_a + need_b]
        width = max(need_a, need_b) + 1
        rows = [(table_a, n) for n in range(1, prompt + 1)] + [(table_b, prefix + i) for i in range(1, chunk + 1)]
        table = torch.zeros(len(rows), width, dtype=torch.int64)
        for r, (t, _) in enumerate(rows):
            table[r, : len(t)] = t
        lens = torch.tensor([n for _, n in rows])
        k = torch.randn(len(blocks), bs, kvh, d, generator=g).to(dtype)
        v = torch.randn(len(blocks), bs, kvh, d, generator=g).to(dtype)
        q = torch.randn(len(rows), heads, d, generator=g).to(dtype)
        nd = NativeDecode(table, lens, int(lens.max()))
        got = native_decode.attend(nd, q, k, v, d**-0.5)
        for r in range(len(rows)):
            alone = native_decode.attend(NativeDecode(table[r : r + 1], lens[r : r + 1], int(lens[r])), q[r : r + 1],
                                         k, v, d**-0.5)
            assert torch.equal(got[r], alone[0]), f"bs {bs}, row {r}"
        ref, bound = _reference(q, k, v, nd, d**-0.5)
        assert ((got.double() - ref).abs().amax(dim=(1, 2)) <= _with_output_rounding(bound, ref, dtype, v)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 50])  # one key; a window starting mid-block, on a block's edge
def test_a_sliding_window_attends_each_rows_last_keys(kernel_ready, dtype, window):
    """Under a window of W keys each row attends its last W (HF's mask), against float64 attention over
    exactly those; a row's bits the same alone as in the batch (the window's start is the row's own);
    a row no longer than the window gets the bits of no window at all."""
    q, k, v, nd = _case(dtype, heads=16, kv_heads=8, d=32)
    scale = 32**-0.5
    got = native_decode.attend(nd, q, k, v, scale, window)
    ref, bound = _reference(q, k, v, nd, scale, window)
    err = (got.double() - ref).abs().amax(dim=(1, 2))
    assert (err <= _with_output_rounding(bound, ref, dtype, v)).all(), f"rows over their bound: {(err / bound).max():.2f}x"
    full = native_decode.attend(nd, q, k, v, scale)
    short = nd.lengths <= window
    assert torch.equal(got[short], full[short])
    assert (~short).sum() > 0 and not torch.equal(got[~short], full[~short])
    for r in (2, 5, int(nd.lengths.argmax())):
        alone = native_decode.attend(NativeDecode(nd.block_table[r : r + 1], nd.lengths[r : r + 1],
                                                  int(nd.lengths[r])), q[r : r + 1], k, v, scale, window)
        assert torch.equal(got[r], alone[0]), f"row {r}"


def test_shapes_it_does_not_take_stay_on_torch():
    assert not native_decode.available(torch.float16, torch.device("cpu"), 9, 3, 64)
    assert not native_decode.available(torch.float32, torch.device("cpu"), 9, 2, 64)  # heads not a multiple
    assert not native_decode.available(torch.float32, torch.device("cpu"), 8, 2, 80)  # not a power-of-two x 16
    assert not native_decode.available(torch.float32, torch.device("cpu"), 256, 8, 64)  # more heads than it holds
    assert not native_decode.available(torch.float32, torch.device("meta"), 9, 3, 64)


def _fresh_kernels(monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    native_kernels.reset()


@pytest.fixture
def restore_kernels():
    yield
    native_kernels.reset()


@pytest.mark.parametrize("native", ["1", "0"])
def test_engine_greedy_matches_hf_with_and_without_the_kernel(native, model_dirs, hf_models, monkeypatch,
                                                              restore_kernels):
    _fresh_kernels(monkeypatch, ROLLOUT_NATIVE_KERNELS=native)
    if native == "1" and native_kernels.library("paged_decode") is None:
        pytest.skip("no C compiler here")
    llm = LLM(EngineConfig(model=model_dirs["llama"], max_num_seqs=16, max_model_len=256, block_size=8))
    assert llm.core.runner.native_decode == (native == "1")
    prompts = random_prompts(12, 3, 90, 2000, seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_models["llama"], p, 20, ignore_eos=True)


def test_a_compiler_that_fails_leaves_the_torch_path(model_dirs, hf_models, monkeypatch, tmp_path, caplog,
                                                     restore_kernels):
    _fresh_kernels(monkeypatch, CC="false", ROLLOUT_KERNEL_CACHE=str(tmp_path), ROLLOUT_NATIVE_KERNELS="1")
    with caplog.at_level(logging.WARNING, logger="engine.kernels.native_kernels"):
        llm = LLM(EngineConfig(model=model_dirs["llama"], max_num_seqs=4, max_model_len=128))
    assert not llm.core.runner.native_decode
    assert any("using the torch path" in r.getMessage() for r in caplog.records)
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    prompt = random_prompts(1, 5, 20, 2000, seed=12)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_models["llama"], prompt, 8, ignore_eos=True)


def test_builds_are_cached_by_source_compiler_and_cpu(monkeypatch, tmp_path, restore_kernels):
    _fresh_kernels(monkeypatch, ROLLOUT_KERNEL_CACHE=str(tmp_path), ROLLOUT_NATIVE_KERNELS="1")
    if native_kernels.library("paged_decode") is None:
        pytest.skip("no C compiler here")
    built = list(tmp_path.iterdir())
    assert len(built) == 1 and built[0].name.startswith("paged_decode-") and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    native_kernels.library.cache_clear()
    assert native_kernels.library("paged_decode") is not None
    assert [p.stat().st_mtime_ns for p in tmp_path.iterdir()] == [stamp]  # loaded again, not rebuilt
