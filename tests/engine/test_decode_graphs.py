"""Decode graphs' bookkeeping (engine/decode_buckets.py, engine/decode_graphs.py) on the CPU: the
buckets, the padding, and whole engines whose decode steps run on the graphs' static buffers with
ROLLOUT_DECODE_GRAPHS=eager (everything but the capture, which tests/gpu/test_cuda.py runs)."""

import copy

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.decode_buckets import bucket_of, pad_decode, row_buckets, width_buckets
from engine.kernels import derived_weights, f32_linears
from engine.sequence import Sequence
from engine.step_inputs import DecodeLayout, pack_decode
from tests.engine.helpers import activation_magnitude, fp32_logprob_tolerance, hf_greedy, random_prompts


def test_row_buckets_step_as_vllms_and_end_at_the_most_rows():
    assert row_buckets(1) == [1]
    assert row_buckets(6) == [1, 2, 4, 6]
    b = row_buckets(300)
    assert b[:6] == [1, 2, 4, 8, 16, 24] and 256 in b and b[-2:] == [288, 300]
    assert all(y - x == 8 for x, y in zip(b[3:], b[4:]) if y <= 256)


def test_width_buckets_are_powers_of_two_to_the_most_blocks():
    assert width_buckets(1) == [1]
    assert width_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert width_buckets(70) == [1, 2, 4, 8, 16, 32, 64, 70]


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    b = row_buckets(64)
    assert [bucket_of(n, b) for n in (1, 3, 8, 9, 64)] == [1, 4, 8, 16, 64]
    assert bucket_of(65, b) is None


def _seqs(lengths, block_size=4):
    out = []
    for i, n in enumerate(lengths):
        s = Sequence(f"r{i}", 0, list(range(100 + i, 100 + i + n)), SamplingParams(), block_size)
        s.block_table = [10 * i + k for k in range(-(-n // block_size))]
        out.append(s)
    return out


def test_padding_keeps_the_real_rows_and_parks_the_pads():
    seqs = _seqs([5, 9, 3])
    buf, layout = pack_decode(seqs, 4)
    padded = pad_decode(buf, layout, rows=4, width=4, pad_slots=[999])
    got = DecodeLayout(4, 4).views(torch.from_numpy(padded))
    want = layout.views(torch.from_numpy(buf))
    for name in ("ids", "positions", "slots", "lengths"):
        assert got[name][:3].tolist() == want[name].tolist()
    assert got["block_table"][:3, :3].tolist() == want["block_table"].tolist()
    assert got["block_table"][:, 3].tolist() == [0] * 4
    # the pad row: token 0 at position 0, one key, writing into the pad slot only
    assert (got["ids"][3], got["positions"][3], got["slots"][3], got["lengths"][3]) == (0, 0, 999, 1)
    assert got["block_table"][3].tolist() == [0] * 4


def test_padding_parks_the_pads_in_each_kv_cache_groups_own_slot():
    """A cache per group of layers (engine/kv_groups.py): each group's table and slots padded alike, its
    pad rows writing into its own spare block."""
    seqs = _seqs([5, 9, 3])
    for i, s in enumerate(seqs):
        s.tables[1] = [b + 500 for b in s.block_table]
    buf, layout = pack_decode(seqs, 4, groups=2)
    padded = pad_decode(buf, layout, rows=4, width=4, pad_slots=[999, 777])
    got = DecodeLayout(4, 4, groups=2).views(torch.from_numpy(padded))
    want = layout.views(torch.from_numpy(buf))
    for g, pad in enumerate((999, 777)):
        assert got["group_slots"][g].tolist() == want["group_slots"][g].tolist() + [pad]
        assert got["group_tables"][g][:3, :3].tolist() == want["group_tables"][g].tolist()
        assert got["group_tables"][g][3].tolist() == got["group_tables"][g][:, 3].tolist() == [0] * 4
    assert got["lengths"].tolist() == want["lengths"].tolist() + [1]


def test_a_step_past_the_bucket_is_refused():
    buf, layout = pack_decode(_seqs([5, 9]), 4)
    with pytest.raises(ValueError, match="does not fit a graph of 1 x 4"):
        pad_decode(buf, layout, rows=1, width=4, pad_slots=[0])
    with pytest.raises(ValueError, match="does not fit a graph of 2 x 2"):
        pad_decode(buf, layout, rows=2, width=2, pad_slots=[0])


@pytest.fixture
def graphs_engine(model_dirs, monkeypatch):
    monkeypatch.setenv("ROLLOUT_DECODE_GRAPHS", "eager")
    # no prepacked copies: a CUDA engine's bf16 linears read their weights as they are (a commit makes
    # derived copies anew, and those move: test_derived_copies_made_anew_drop_the_graphs)
    llm = LLM(EngineConfig(model=model_dirs["qwen2"], max_num_seqs=12, max_model_len=128, prepack_linears=False))
    assert llm.core.runner.graph_mode == "eager"
    return llm


def test_greedy_on_the_graphs_buffers_matches_hf(graphs_engine, hf_models):
    runner = graphs_engine.core.runner
    graphs = runner.decode_graphs
    # 5, then 12 sequences of 4-100 tokens, then 3 of 4-12: padded rows (8 of 5, 4 of 3), widths of 1-7 blocks
    for n, longest, seed in ((5, 100, 13), (12, 100, 14), (3, 12, 15)):
        prompts = random_prompts(n, 4, longest, 2000, seed=seed)
        outs = graphs_engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                      use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_models["qwen2"], p, 10, ignore_eos=True)
                                                          for p in prompts]
    assert {r for r, _ in graphs.graphs} == {4, 8, 12} and len({w for _, w in graphs.graphs}) >= 2
    assert graphs.captures == len(graphs.graphs)
    # the pad rows wrote into the block past the block manager's, and only there
    assert runner.k_cache.shape[1] == runner.num_blocks + 1
    assert runner.k_cache[:, runner.num_blocks, 0].abs().sum() > 0


def test_sampled_logprobs_on_the_graphs_buffers_match_the_eager_engines(graphs_engine, model_dirs, hf_models,
                                                                        monkeypatch):
    monkeypatch.delenv("ROLLOUT_DECODE_GRAPHS")
    eager = LLM(EngineConfig(model=model_dirs["qwen2"], max_num_seqs=12, max_model_len=128))
    assert eager.core.runner.decode_graphs is None
    prompts = random_prompts(6, 4, 40, 2000, seed=5)
    params = [SamplingParams(max_tokens=12, seed=k, ignore_eos=True, logprobs=0) for k in range(6)]
    a = graphs_engine.generate(prompts, params, use_tqdm=False)
    b = eager.generate(prompts, params, use_tqdm=False)
    hf = hf_models["qwen2"]
    for p, x, y in zip(prompts, a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        # the two paths sum attention in different orders (padded keys through SDPA, the C kernel)
        tol = fp32_logprob_tolerance(hf.config, activation_magnitude(hf, p + x.outputs[0].token_ids))
        assert x.outputs[0].logprobs == pytest.approx(y.outputs[0].logprobs, abs=tol)


def test_weights_written_in_place_keep_the_graphs_and_moved_ones_drop_them(graphs_engine, hf_models):
    worker = graphs_engine.core.worker
    graphs = worker.runner.decode_graphs
    prompt = random_prompts(1, 10, 10, 2000, seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    graphs_engine.generate([prompt], params, use_tqdm=False)
    held = set(graphs.graphs)
    assert held
    hf = copy.deepcopy(hf_models["qwen2"])
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.05)
        trained = dict(hf.named_parameters())
        for n, p in worker.model.named_parameters():  # a commit that copies: the same storage
            p.copy_(trained[n])
    worker.weights_written()
    assert set(graphs.graphs) == held
    want = hf_greedy(hf, prompt, 8, ignore_eos=True)
    assert graphs_engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    first = next(worker.model.parameters())  # a commit that swaps: new storage
    first.data = first.data.clone()
    worker.weights_written()
    assert graphs.graphs == {}
    assert graphs_engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert graphs.graphs


@pytest.fixture(params=["1", "0"], ids=["our-kernel", "onednn"])
def f32_kernel(request, monkeypatch):
    """Our fp32 kernel's panels (plain tensors) or, with it off, oneDNN's packed copies (no storage to point at)."""
    monkeypatch.setenv("ROLLOUT_F32_KERNEL", request.param)
    f32_linears.available.cache_clear()
    yield request.param
    monkeypatch.undo()
    f32_linears.available.cache_clear()


def test_derived_copies_made_anew_drop_the_graphs(model_dirs, monkeypatch, f32_kernel):
    monkeypatch.setenv("ROLLOUT_DECODE_GRAPHS", "eager")
    llm = LLM(EngineConfig(model=model_dirs["qwen2"], max_num_seqs=4, max_model_len=64))  # prepacked linears
    graphs = llm.core.runner.decode_graphs
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert graphs.graphs
    # held here, so the copies made again cannot land where these lie (freed, they might: then the
    # graphs would rightly stay)
    old = list(derived_weights.served_tensors(llm.core.worker.model))
    assert old
    llm.core.worker.weights_written()  # a commit with no copies staged: every copy is made again
    assert graphs.graphs == {}


def test_a_copy_laid_out_alike_is_written_into_the_served_one_and_no_other():
    from engine.kernels.derived_weights import copy_into
    from engine.kernels.fp8_linears import Fp8Weight

    served = Fp8Weight(torch.zeros(8, 4).t(), torch.zeros(1, 4))
    new = Fp8Weight(torch.randn(8, 4).t(), torch.randn(1, 4))
    assert copy_into(served, new)
    assert torch.equal(served.q_t, new.q_t) and torch.equal(served.scale, new.scale)
    other = Fp8Weight(torch.randn(4, 8), torch.randn(1, 4))  # the same shape, another stride: not alike
    before = served.q_t.clone()
    assert not copy_into(served, Fp8Weight(other.q_t, torch.randn(1, 4)))
    assert torch.equal(served.q_t, before)  # nothing written, the scale neither
    assert not copy_into(served, Fp8Weight(torch.randn(8, 5).t(), new.scale))


@pytest.mark.skipif(not f32_linears.available(), reason="the fp32 kernel's panels (plain tensors) serve on AVX-512")
def test_a_push_with_staged_copies_keeps_the_graphs_and_serves_the_pushed_weights(model_dirs, hf_models, monkeypatch):
    """A push's commit as ParamsTarget makes it: the copies staged from the pushed weights, the
    weights copied in, then `weights_written`. With graphs, the staged panels are copied into the
    served ones: nothing a graph reads moves."""
    monkeypatch.setenv("ROLLOUT_DECODE_GRAPHS", "eager")
    llm = LLM(EngineConfig(model=model_dirs["qwen2"], max_num_seqs=4, max_model_len=64))  # fp32 panels
    worker = llm.core.worker
    graphs = worker.runner.decode_graphs
    prompt = random_prompts(1, 10, 10, 2000, seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    held, where = set(graphs.graphs), graphs._weights_read()
    assert held and len(where) > sum(1 for _ in worker.model.parameters())  # the panels are counted too
    hf = copy.deepcopy(hf_models["qwen2"])
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.05)
    trained = dict(hf.named_parameters())
    pairs = [(p, trained[n].detach().clone()) for n, p in worker.model.named_parameters()]
    staged = worker.stage_derived_copies(pairs)
    with torch.no_grad():
        for p, t in pairs:
            p.copy_(t)
    worker.weights_written(staged)
    assert set(graphs.graphs) == held and graphs._weights_read() == where
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8,
                                                                                             ignore_eos=True)
