"""engine/kernels/huge_pages.py: the weights onto 2 MB pages (MADV_COLLAPSE, Linux 6.1+) under a running
engine, their values untouched; where the kernel cannot, nothing changes."""

import mmap

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.kernels import huge_pages
from engine.models import llama_model
from tests.engine.helpers import random_prompts


def huge_bytes(address: int) -> int:
    """Bytes of the mapping around `address` on 2 MB pages (anonymous or shmem), from /proc/self/smaps."""
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:"):
                total += int(line.split()[1]) * 1024
    return total


def collapses_here() -> bool:
    buf = mmap.mmap(-1, 3 * huge_pages.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.fill_(1)
    return huge_pages.collapse_range(t.data_ptr(), t.numel()) > 0


needs_collapse = pytest.mark.skipif(not collapses_here(), reason="this kernel does not collapse pages (MADV_COLLAPSE)")


@needs_collapse
def test_a_written_buffer_goes_onto_huge_pages_with_its_bytes():
    buf = mmap.mmap(-1, 8 * huge_pages.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    before = t.clone()
    assert huge_bytes(t.data_ptr()) == 0
    done = huge_pages.collapse(t)
    assert done >= 7 * huge_pages.HUGE and huge_bytes(t.data_ptr()) >= done  # the whole 2 MB pages inside it
    assert torch.equal(t, before)


@needs_collapse
def test_a_hold_keeps_the_pages_still_until_it_ends():
    """A push holds the collapser while it writes and merges: nothing moves meanwhile, and the work
    in hand is done once the hold ends."""
    buf = mmap.mmap(-1, 8 * huge_pages.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.fill_(3)
    c = huge_pages.Collapser()
    with c.held():
        c.request([t])
        assert not c.idle.wait(0.5) and huge_bytes(t.data_ptr()) == 0
    assert c.idle.wait(60) and c.done_bytes >= 7 * huge_pages.HUGE and huge_bytes(t.data_ptr()) >= c.done_bytes


def test_pages_with_holes_are_left_as_they_are():
    """A collapse fills a 2 MB page's holes with zeros: memory the process never used. Only pages
    written whole are moved."""
    buf = mmap.mmap(-1, 4 * huge_pages.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t[::huge_pages.HUGE // 2] = 1  # two 4 KB pages of each 2 MB
    assert huge_pages.collapse(t) == 0 and huge_bytes(t.data_ptr()) == 0


@needs_collapse
def test_the_page_tables_say_which_pages_need_moving(monkeypatch):
    """Asked once a range (PAGEMAP_SCAN): pages written whole and on 4 KB pages are listed, pages
    with holes are not, pages on huge pages count as done; a second collapse calls madvise for
    nothing (after each push the collapser goes over weights already moved)."""
    buf = mmap.mmap(-1, 6 * huge_pages.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    start = -(-t.data_ptr() // huge_pages.HUGE) * huge_pages.HUGE
    offset = start - t.data_ptr()
    t[offset:offset + 3 * huge_pages.HUGE] = 1  # three whole pages written; the rest: one 4 KB page each
    t[offset + 3 * huge_pages.HUGE::huge_pages.HUGE] = 1
    asked = huge_pages.pages_to_collapse(start, start + 5 * huge_pages.HUGE)
    if asked is None:
        pytest.skip("this kernel has no PAGEMAP_SCAN (Linux 6.7+): pages are asked one by one")
    assert asked == ([start + k * huge_pages.HUGE for k in range(3)], 0)
    assert huge_pages.collapse_range(start, 5 * huge_pages.HUGE) == 3 * huge_pages.HUGE
    assert huge_pages.pages_to_collapse(start, start + 5 * huge_pages.HUGE) == ([], 3 * huge_pages.HUGE)
    calls = []
    real = huge_pages.madvise()
    monkeypatch.setattr(huge_pages, "madvise", lambda: lambda *a: calls.append(a) or real(*a))
    assert huge_pages.collapse_range(start, 5 * huge_pages.HUGE) == 3 * huge_pages.HUGE and calls == []


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    t = torch.ones(4 * huge_pages.HUGE, dtype=torch.uint8)
    assert huge_pages.collapse(t) == 0


def test_what_has_no_storage_to_reach_is_left_alone():
    """oneDNN's prepacked copies (the fp32 or bf16 engine's on a CPU without our kernels) are opaque:
    skipped, not an error that would end the collapser's thread."""
    opaque = torch.ops.mkldnn._reorder_linear_weight(torch.randn(2048, 1024))
    assert opaque.layout != torch.strided and huge_pages.collapse([opaque]) == 0
    c = huge_pages.Collapser()
    c.request([opaque])
    assert c.idle.wait(10) and c.done_bytes == 0


def test_moved_parameters_keep_their_values_and_their_ties(qwen2_dir):
    model = llama_model.load(qwen2_dir, torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert huge_pages.move_parameters(model) > 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1  # one buffer, from a 2 MB boundary
    assert next(model.parameters()).data_ptr() % huge_pages.HUGE == 0


@needs_collapse
def test_a_started_engine_serves_from_huge_pages_the_tokens_it_gave_before(qwen2_dir, monkeypatch):
    prompts = random_prompts(3, 4, 20, 400, seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(huge_pages.ENV_SWITCH, switch)
        llm = LLM(EngineConfig(model=qwen2_dir, max_num_seqs=4, max_model_len=128))
        worker = llm.core.worker
        assert worker.collapser.idle.wait(60)
        weights = next(worker.model.parameters())
        assert (huge_bytes(weights.data_ptr()) > 0) == (switch == "1")
        outs[switch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["1"] == outs["0"]
