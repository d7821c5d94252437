"""A step's inputs go to the device as one packed array; decode attention runs on chunks cut by
padding cost. The packing, the cut, and exactness whatever the cut."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.sampling_params import SamplingParams as Params
from engine.sequence import Sequence
from engine.step_inputs import chunk_cuts, pack_decode
from tests.engine.helpers import hf_greedy, random_prompts


def test_no_overhead_cuts_at_every_block_count():
    assert chunk_cuts([1, 1, 2, 3, 3, 3], overhead_rows=0) == [(0, 2, 1), (2, 3, 2), (3, 6, 3)]


def test_a_cut_is_made_only_where_the_padding_saved_outweighs_a_chunk():
    # cutting below the 4 saves 6 rows x 1 block; below the 3s saves 1 row x 1 block
    assert chunk_cuts([2, 3, 3, 3, 3, 3, 4], overhead_rows=5) == [(0, 6, 3), (6, 7, 4)]
    assert chunk_cuts([2, 3, 3, 3, 3, 3, 4], overhead_rows=6) == [(0, 7, 4)]
    assert chunk_cuts([5], overhead_rows=0) == [(0, 1, 5)]
    assert chunk_cuts([1, 8], overhead_rows=float("inf")) == [(0, 2, 8)]


def _seq(tokens: list[int], table: list[int]) -> Sequence:
    seq = Sequence("r", 0, tokens, Params(), block_size=4)
    seq.block_table = table
    return seq


def test_pack_decode_lays_out_ids_positions_slots_lengths_and_padded_tables():
    seqs = [_seq([5, 6, 7], [9]), _seq([1, 2, 3, 4, 5, 6], [2, 7])]
    buf, layout = pack_decode(seqs, block_size=4)
    v = {k: t.numpy() for k, t in layout.views(torch.from_numpy(buf)).items() if torch.is_tensor(t)}
    assert v["ids"].tolist() == [7, 6]
    assert v["positions"].tolist() == [2, 5]
    assert v["slots"].tolist() == [9 * 4 + 2, 7 * 4 + 1]
    assert v["lengths"].tolist() == [3, 6]
    assert v["block_table"].tolist() == [[9, 0], [2, 7]]


def test_pack_decode_lays_out_each_kv_cache_groups_slots_and_table():
    """A model with a cache per group of layers (engine/kv_groups.py): the second group's table (its first
    block gone back behind a window: the spare, 11) and the slots in it ride after the first's."""
    seqs = [_seq([5, 6, 7], [9]), _seq([1, 2, 3, 4, 5, 6], [2, 7])]
    seqs[0].tables[1], seqs[1].tables[1] = [3], [11, 4]
    buf, layout = pack_decode(seqs, block_size=4, groups=2)
    views = layout.views(torch.from_numpy(buf))
    assert views["lengths"].tolist() == [3, 6]
    assert [t.tolist() for t in views["group_slots"]] == [[9 * 4 + 2, 7 * 4 + 1], [3 * 4 + 2, 4 * 4 + 1]]
    assert [t.tolist() for t in views["group_tables"]] == [[[9, 0], [2, 7]], [[3, 0], [11, 4]]]
    assert buf.size == 4 * 2 + 2 * 2 + 2 + 2 * 2


@pytest.mark.parametrize("cost", [0.0, float("inf")], ids=["a-chunk-per-block-count", "one-chunk"])
def test_greedy_exact_whatever_the_cut(cost, model_dirs, hf_models):
    llm = LLM(EngineConfig(model=model_dirs["qwen2"], max_num_seqs=16, max_model_len=256, block_size=4))
    llm.core.runner.decode_chunk_cost = cost
    prompts = random_prompts(10, 2, 60, 2000, seed=11)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_models["qwen2"], p, 20, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_layers_compute_what_hf_layers_do_bit_for_bit(arch, model_dirs, monkeypatch):
    """The fused decoder layers (engine/models/fused_layers.py) do HF's arithmetic op for op: the
    same prompts give identical logits, in prefill (with a cached prefix) and decode."""
    from engine.models import fused_layers, native_layers

    monkeypatch.setenv(native_layers.ENV_SWITCH, "0")  # the fp32 C loop's norm is C's (tests/engine/test_native_layers.py)

    prompts = random_prompts(6, 3, 40, 2000, seed=5)
    prompts.append(prompts[0][:10] + [7, 8, 9])  # extends a cached prefix: the gathered-prefill path
    runs = {}
    for fuse in (True, False):
        # batch_invariant off: the fp32 prefills keep torch's norms and silu (on, they run the C loop's)
        llm = LLM(EngineConfig(model=model_dirs[arch], max_num_seqs=8, max_model_len=128, fuse_layers=fuse,
                               batch_invariant=False))
        assert (fused_layers.unsupported(llm.core.runner.model) is None) and (
            llm.core.runner.model.model.layers[0].forward.__func__ is fused_layers._layer_forward) == fuse
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
                           use_tqdm=False)
        runs[fuse] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]
    assert runs[True] == runs[False]
