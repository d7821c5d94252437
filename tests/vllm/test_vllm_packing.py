"""vLLM's weight-transfer chunks read as our manifest (weight_sync/vllm/packing.py): the chunk
boundaries equal what vLLM's own `pack_tensors` makes of a real model's tensors, and a bad
update_info is refused naming its field."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.packed_tensor import pack_tensors  # noqa: E402

from weight_sync.common.manifest import check_layout  # noqa: E402
from weight_sync.vllm.packing import chunk_bounds, update_manifest, update_problems  # noqa: E402

# SmolLM2-135M's architecture (its config.json): 30 layers, a 49152 x 576 tied embedding (54 MiB in bf16)
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)


def _vllm_chunks(named, buffer_bytes):
    """The (names) of each chunk vLLM's trainer would broadcast."""
    it, chunks = iter(named), []
    while (chunk := pack_tensors(it, lambda item: item[1], buffer_bytes)) is not None:
        chunks.append((chunk.names, chunk.packed_tensor.numel()))
    return chunks


@pytest.mark.parametrize("buffer_mib", [8, 64, 1024])
def test_our_chunks_are_vllms_for_smollm2(buffer_mib):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(SMOLLM2, dtype=torch.bfloat16)
    # ModuleSource sends named_parameters(): the tied lm_head.weight never comes
    named = [(n, torch.empty(p.shape, dtype=p.dtype)) for n, p in model.named_parameters()]
    info = {"names": [n for n, _ in named], "dtype_names": ["bfloat16"] * len(named),
            "shapes": [list(t.shape) for _, t in named]}
    m = update_manifest(info, buffer_mib << 20)
    assert check_layout(m) == []
    want = _vllm_chunks(named, buffer_mib << 20)
    assert [([t.name for t in m.tensors[b.first:b.last]], b.nbytes) for b in m.buckets] == want
    if buffer_mib == 8:  # the 54 MiB embedding against an 8 MiB buffer: a chunk of its own
        assert want[0] == (["model.embed_tokens.weight"], 49152 * 576 * 2)


def test_chunk_bounds_edge_cases():
    assert chunk_bounds([], 10) == []
    assert chunk_bounds([10], 10) == [(0, 1)]  # not over the size: one chunk
    assert chunk_bounds([5, 6, 1], 10) == [(0, 2), (2, 3)]  # 11 > 10 closes the chunk with the crossing tensor
    assert chunk_bounds([30, 1, 1], 10) == [(0, 1), (1, 3)]
    with pytest.raises(ValueError):
        chunk_bounds([1], 0)


def test_a_bad_update_info_names_its_field():
    assert update_problems({"names": "x", "dtype_names": [], "shapes": []}) == ["update_info.names must be a list"]
    assert "differ in length" in update_problems({"names": ["a"], "dtype_names": [], "shapes": []})[0]
    assert "update_info.dtype_names: a: 'complex64'" in update_problems(
        {"names": ["a"], "dtype_names": ["complex64"], "shapes": [[2]]})[0]
    assert "update_info.shapes: a" in update_problems({"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]})[0]
    with pytest.raises(ValueError, match="update_info.shapes"):
        update_manifest({"names": ["a"], "dtype_names": ["float32"], "shapes": ["2"]})
