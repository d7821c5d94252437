"""A push and the huge-page collapser (engine/kernels/huge_pages.py): after a commit, the memory the next
push writes into (the staging buffer the commit freed) goes onto 2 MB pages before the served
weights, so that in a sidecar that keeps its staging the next push's weights arrive on huge pages
and no page is moved under a running decode step."""

import os
import struct

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, EngineConfig
from engine.kernels import huge_pages
from tests.engine.test_huge_pages import needs_collapse
from weight_sync.trainer.file_push import write_safetensors

EXTENSION = "weight_sync.engine_side.extension:WeightSyncExtension"
KPF_THP = 22  # /proc/kpageflags: the page is part of a transparent huge page


def huge_pages_in(t: torch.Tensor) -> tuple[int, int]:
    """(on huge pages, in all): the whole 2 MB pages inside `t`'s storage, each looked up through
    /proc/self/pagemap and /proc/kpageflags (root only): smaps counts per mapping, and a mapping
    may hold other buffers."""
    start = -(-t.untyped_storage().data_ptr() // huge_pages.HUGE) * huge_pages.HUGE
    end = (t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()) // huge_pages.HUGE * huge_pages.HUGE
    pages = range(start, end, huge_pages.HUGE)
    with open("/proc/self/pagemap", "rb") as pagemap, open("/proc/kpageflags", "rb") as flags:
        huge = 0
        for at in pages:
            pagemap.seek(at // 4096 * 8)
            (entry,) = struct.unpack("<Q", pagemap.read(8))
            pfn = entry & ((1 << 55) - 1)
            if entry >> 63 and pfn:
                flags.seek(pfn * 8)
                huge += struct.unpack("<Q", flags.read(8))[0] >> KPF_THP & 1
    return huge, len(pages)


@needs_collapse
@pytest.mark.skipif(os.geteuid() != 0, reason="page frames are read from /proc/kpageflags, root only")
def test_the_next_pushs_staging_goes_onto_huge_pages_after_a_commit(qwen2_dir, tmp_path):
    trainer = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    with torch.no_grad():
        for version in (1, 2):
            for p in trainer.parameters():
                p.add_(0.01)
            write_safetensors(trainer, tmp_path / f"v{version}", version)
    llm = LLM(EngineConfig(model=qwen2_dir, max_model_len=128, worker_extension_cls=EXTENSION))
    worker = llm.core.worker
    assert worker.collapser.idle.wait(60)
    with worker.collapser.held():  # both pushes land before the collapser moves a page: what it then
        worker.load_weights_from_path(str(tmp_path / "v1"))  # has in hand is the second commit's request
        worker.load_weights_from_path(str(tmp_path / "v2"))
    receiver = worker._receiver()
    spare, served = receiver.pool.spare, next(worker.model.parameters())
    assert spare is not None  # the first push's buffer, free for the third
    huge, pages = huge_pages_in(spare)
    assert pages >= 2
    if huge == pages:  # a process's freed huge pages may come back to a fresh buffer: nothing to show
        pytest.skip("the staging buffer came on huge pages already")
    assert worker.collapser.idle.wait(60)
    assert huge_pages_in(spare) == (pages, pages)
    assert huge_pages_in(served)[0] > 0
