"""weight_sync/engine_side/shared_buffers.py: a sidecar's staging buffers, files in /dev/shm, mapped
from a 2 MB boundary so that the weights served from them can go onto huge pages (mapped where the
kernel chose, every MADV_COLLAPSE of them failed), and unmapped once the last view goes."""

import gc

import pytest
import torch

from engine.kernels import huge_pages
from tests.engine.test_huge_pages import needs_collapse
from weight_sync.engine_side import shared_buffers

pytestmark = pytest.mark.skipif(not shared_buffers.available(), reason="no writable /dev/shm")


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(int(lo, 16) <= address < int(hi, 16)
                   for lo, hi in (line.split()[0].split("-") for line in f))


@pytest.mark.parametrize("populate", [True, False])
def test_a_buffer_starts_on_a_2mb_boundary_and_holds_what_is_written(populate):
    t, path = shared_buffers.new_buffer(3 * huge_pages.HUGE + 4096, populate=populate)
    try:
        assert t.data_ptr() % huge_pages.HUGE == 0 and t.numel() == 3 * huge_pages.HUGE + 4096
        data = torch.randint(0, 256, t.shape, dtype=torch.uint8)
        t.copy_(data)
        with open(path, "rb") as f:  # the file is the buffer
            assert f.read() == data.numpy().tobytes()
    finally:
        shared_buffers.let_go(path)


@needs_collapse
def test_a_written_buffer_goes_onto_huge_pages_with_its_bytes():
    t, path = shared_buffers.new_buffer(4 * huge_pages.HUGE)
    try:
        data = torch.randint(0, 256, t.shape, dtype=torch.uint8)
        t.copy_(data)
        assert huge_pages.collapse(t) == 4 * huge_pages.HUGE
        asked = huge_pages.pages_to_collapse(t.data_ptr(), t.data_ptr() + t.numel())
        assert asked is None or asked == ([], 4 * huge_pages.HUGE)
        assert torch.equal(t, data)
    finally:
        shared_buffers.let_go(path)


def test_the_mapping_goes_with_its_last_view():
    t, path = shared_buffers.new_buffer(2 * huge_pages.HUGE)
    shared_buffers.let_go(path)
    address = t.data_ptr()
    view = t[100:200]
    view.fill_(7)
    del t
    gc.collect()
    assert mapped(address) and int(view.sum()) == 700  # a view keeps it
    del view
    gc.collect()
    assert not mapped(address)
