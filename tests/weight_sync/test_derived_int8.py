"""An int8 engine's copies are derived copies too (engine/kernels/int8_linears.py through
engine/kernels/derived_weights.py): a push builds them from its staged full-precision weights while the
engine serves, the first forward after the commit derives nothing, the checksums are the
trainer's (the full-precision truth) and greedy output is a fresh int8 engine's on the same weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import AsyncEngine, EngineConfig
from engine.kernels import int8_linears
from tests.weight_sync.test_derived_copies import (EXTENSION, PROMPTS, TIMEOUT_S, _form, fresh_engine_greedy, greedy,
                                                   overlapped_push, packed_copies, perturb, rpc, run, served_copies)
from weight_sync import WeightSender, weights_checksum

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(int8_linears.kernel() is None, reason="no exact int8 kernel")]


@pytest.fixture(scope="module")
def engine(qwen2_dir, loop, packed_copies):  # the kept fp32 head on a packed copy: a derived one too
    e = AsyncEngine(EngineConfig(model=qwen2_dir, max_num_seqs=4, max_model_len=128, kv_cache_memory_gb=0.05,
                                 worker_extension_cls=EXTENSION, quantization="int8"))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def sender():
    s = WeightSender(bucket_bytes=1 << 18, timeout_s=TIMEOUT_S)
    yield s
    s.close_group()


def test_an_int8_push_derives_while_staged_and_serves_the_new_weights_at_once(engine, sender, loop, qwen2_dir,
                                                                                tmp_path):
    trainer = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    run(loop, _form(engine, sender))
    run(loop, greedy(engine, PROMPTS[:1]))
    run(loop, rpc(engine, "derive_count"))
    perturb(trainer, 3)
    run(loop, overlapped_push(engine, sender, trainer, 1))
    assert run(loop, rpc(engine, "derive_count")) == served_copies(trainer)  # int8 and the kept head's prepacked copy
    got = run(loop, greedy(engine))
    assert run(loop, rpc(engine, "derive_count")) == 0
    assert run(loop, engine.collective_rpc("weights_checksum")) == [weights_checksum(trainer.named_parameters())]
    assert got == fresh_engine_greedy(qwen2_dir, trainer, tmp_path, quantization="int8")
