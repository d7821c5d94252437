"""The CUDA paths, run where CUDA is (`python -m pytest -m gpu tests/gpu`); skipped elsewhere."""

import asyncio

import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from tests.engine.helpers import hf_greedy, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def test_greedy_on_cuda_matches_hf_on_cuda(qwen2_dir, hf_models):
    llm = LLM(EngineConfig(model=qwen2_dir, device="cuda", max_model_len=256))
    hf = hf_models["qwen2"].to("cuda")
    try:
        prompts = random_prompts(8, 4, 40, 2000, seed=120)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        with torch.device("cuda"):
            want = [hf_greedy(hf, p, 16, ignore_eos=True) for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        hf_models["qwen2"].to("cpu")


def test_seeded_sampling_on_cuda_ignores_the_batch(qwen2_dir):
    llm = LLM(EngineConfig(model=qwen2_dir, device="cuda", max_model_len=256))
    p = [5, 6, 7, 8]
    alone = llm.generate([p], SamplingParams(max_tokens=12, seed=3, ignore_eos=True), use_tqdm=False)
    crowd = llm.generate([p] + random_prompts(7, 4, 20, 2000, seed=121),
                         [SamplingParams(max_tokens=12, seed=3, ignore_eos=True)] + [SamplingParams(max_tokens=12)] * 7,
                         use_tqdm=False)
    assert alone[0].outputs[0].token_ids == crowd[0].outputs[0].token_ids


def test_kv_cache_follows_gpu_memory_utilization(qwen2_dir):
    small = LLM(EngineConfig(model=qwen2_dir, device="cuda", max_model_len=256, max_num_seqs=10**6,
                             gpu_memory_utilization=0.2))
    runner = small.core.runner
    total = torch.cuda.get_device_properties(runner.device).total_memory
    assert runner.k_cache.nbytes + runner.v_cache.nbytes <= 0.2 * total
    # rows past what the cache serves sized nothing: a step's rows are at most its blocks
    assert runner.max_num_seqs <= runner.num_blocks
    out = small.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4] * 4


def test_an_engine_that_fails_to_start_frees_its_gpu_memory(qwen2_dir):
    import gc

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(EngineConfig(model=qwen2_dir, device="cuda", max_model_len=256, num_kv_blocks=1))
    gc.collect()
    assert torch.cuda.memory_allocated() == before


def test_two_ranks_on_one_gpu_are_refused_by_name(qwen2_dir):
    from weight_sync import EXTENSION, WeightSender
    from weight_sync.trainer.local_engines import init_weight_sync

    async def run():
        engine = AsyncEngine(EngineConfig(model=qwen2_dir, device="cuda:0", max_model_len=256,
                                          worker_extension_cls=EXTENSION))
        try:
            with pytest.raises(Exception, match="both on GPU"):
                await init_weight_sync([engine], WeightSender(device="cuda:0", timeout_s=20))
        finally:
            engine.shutdown()

    asyncio.run(run())


@two_gpus
def test_a_push_over_nccl_reaches_the_engine_exactly(qwen2_dir, hf_models):
    from weight_sync import EXTENSION, WeightSender, flatten_parameters
    from weight_sync.engine_side.engines import engines_checksums
    from weight_sync.trainer.local_engines import init_weight_sync, push_to_engines

    async def run():
        engine = AsyncEngine(EngineConfig(model=qwen2_dir, device="cuda:1", max_model_len=256,
                                          worker_extension_cls=EXTENSION))
        trainer = type(hf_models["qwen2"]).from_pretrained(qwen2_dir, dtype=torch.float32).to("cuda:0")
        flatten_parameters(trainer)  # the zero-copy path, on CUDA
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(1.01)
        sender = WeightSender(device="cuda", timeout_s=60)  # normalised to cuda:0
        try:
            info = await init_weight_sync([engine], sender)
            assert sender.group.backend_name == "nccl" and info["world_size"] == 2
            await push_to_engines([engine], sender, trainer, version=1)
            assert await engines_checksums([engine]) == [sender.checksum(trainer)]
        finally:
            sender.close_group()
            engine.shutdown()

    asyncio.run(run())


def _colocated(qwen2_dir, hf_models):
    """An engine (weight sync on) and an fp32 trainer on cuda:0, the trainer's weights in one shared
    buffer, and the sender: a colocated push's three parts."""
    from weight_sync import EXTENSION, WeightSender, flatten_parameters

    engine = AsyncEngine(EngineConfig(model=qwen2_dir, device="cuda:0", max_model_len=256,
                                      gpu_memory_utilization=0.3, worker_extension_cls=EXTENSION))
    trainer = type(hf_models["qwen2"]).from_pretrained(qwen2_dir, dtype=torch.float32).to("cuda:0")
    flatten_parameters(trainer, shared=True)
    return engine, trainer, WeightSender()


def test_a_colocated_push_through_cuda_ipc(qwen2_dir, hf_models):
    """Trainer and engine on one GPU: the engine maps the trainer's buffer by CUDA IPC handle."""
    from weight_sync.engine_side.engines import engines_checksums
    from weight_sync.trainer.local_engines import push_shared_to_engines

    async def run():
        engine, trainer, sender = _colocated(qwen2_dir, hf_models)
        try:
            for version in (1, 2):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.mul_(1.01)
                out = await push_shared_to_engines([engine], sender, trainer, version)
                assert out["worker_results"][0]["transport"] == "shared (cuda)"
                assert await engines_checksums([engine]) == [sender.checksum(trainer)]
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_decode_on_graphs_matches_eager_and_replays(qwen2_dir):
    prompts = random_prompts(12, 4, 60, 2000, seed=122)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphed = LLM(EngineConfig(model=qwen2_dir, device="cuda", max_model_len=256, gpu_memory_utilization=0.3))
    eager = LLM(EngineConfig(model=qwen2_dir, device="cuda", max_model_len=256, gpu_memory_utilization=0.3,
                             enforce_eager=True))
    assert eager.core.runner.decode_graphs is None
    a = graphed.generate(prompts, params, use_tqdm=False)
    b = eager.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    stats = graphed.core.runner.graph_stats()
    assert stats["mode"] == "capture" and stats["captured"] >= 1 and stats["replayed"] > stats["captured"]


def test_a_push_into_a_graphed_engine_lands_and_replays_without_a_capture(qwen2_dir, hf_models):
    """A colocated push (CUDA IPC) into an engine on decode graphs: copied into the weights where they
    lie, so the next steps replay the graphs captured before it, on the pushed weights (digest;
    greedy equal to a fresh engine loaded from those weights)."""
    from weight_sync.engine_side.engines import engines_checksums
    from weight_sync.trainer.local_engines import push_shared_to_engines

    prompts = random_prompts(6, 4, 40, 2000, seed=123)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def run(pushed_dir):
        engine, trainer, sender = _colocated(qwen2_dir, hf_models)
        try:
            await _greedy_all(engine, prompts, params, "before")
            before = (await engine.collective_rpc("model_info"))[0]["decode_graphs"]
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(1.01)
            await push_shared_to_engines([engine], sender, trainer, 1)
            assert await engines_checksums([engine]) == [sender.checksum(trainer)]
            outs = await _greedy_all(engine, prompts, params, "after")
            after = (await engine.collective_rpc("model_info"))[0]["decode_graphs"]
            trainer.save_pretrained(pushed_dir)
            return before, after, outs
        finally:
            engine.shutdown()

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        before, after, outs = asyncio.run(run(d))
        fresh = LLM(EngineConfig(model=d, tokenizer=qwen2_dir, device="cuda", max_model_len=256,
                                 gpu_memory_utilization=0.3))
        want = [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)]
    assert outs == want
    assert after["replayed"] > before["replayed"] and after["captured"] == before["captured"] > 0


async def _greedy_all(engine, prompts, params, tag):
    ids = [f"{tag}-{k}" for k in range(len(prompts))]
    final = {}
    async for out in engine.generate(prompts, params, request_id=ids):
        if out.finished:
            final[out.request_id] = out.outputs[0].token_ids
    return [final[i] for i in ids]
