"""The overlapped receive runs inside the worker's receive-stream hook, on its own thread: on
CUDA that hook is a stream of its own (weight_sync/engine_side/overlapped_receive.py), so a broadcast that
never completes does not queue the forward's kernels behind it. Here (CPU, gloo) the hook is a
recording one; the push is real."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import AsyncEngine, EngineConfig
from weight_sync import WeightSender
from weight_sync.engine_side.engines import engines_checksums, finish_on_engines, join_engines, stage_on_engines
from weight_sync.trainer.push import run_push

pytestmark = pytest.mark.timeout(180)


def test_the_overlapped_receive_runs_inside_the_stream_hook_on_its_thread(qwen2_dir, loop):
    cfg = EngineConfig(model=qwen2_dir, max_num_seqs=4, max_model_len=128, kv_cache_memory_gb=0.05,
                       worker_extension_cls="tests.weight_sync.stream_extension:RecordingReceiveStream")
    engine = AsyncEngine(cfg)
    sender = WeightSender(timeout_s=20)
    trainer = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.01)

    async def push():
        info = sender.open_group(world_size=2, timeout_s=20)
        await asyncio.gather(asyncio.to_thread(sender.join_group), join_engines([engine], info, 1))

        def deliver(m):
            async def staged_then_finished():
                staged = await stage_on_engines([engine], m, 30, sender.group.group_name)
                return (await finish_on_engines([engine], staged, commit=True, timeout=30))[0]
            return [("engine 0", asyncio.ensure_future(staged_then_finished()))]

        outcome = await run_push(sender, trainer, 1, deliver)
        assert not isinstance(outcome.results[0], BaseException), outcome.results[0]
        return (await engine.collective_rpc("receive_stream_log"))[0], await engines_checksums([engine])

    try:
        log, checksums = loop.run_until_complete(push())
        assert [tuple(e) for e in log] == [("enter", "weight-sync-receive"), ("exit", "staging allocated inside")]
        assert checksums == [sender.checksum(trainer)]
    finally:
        sender.close_group()
        engine.shutdown()
