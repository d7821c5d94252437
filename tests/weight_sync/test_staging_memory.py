"""Staging memory given back under a live mapping (weight_sync.engine_side.staging_memory.drop_pages): what a
given-up push relies on to free its buffer while a transfer it cannot stop may still write."""

import torch

from weight_sync.engine_side.staging_memory import alloc, drop_pages

MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_dropped_staging_pages_leave_the_process_and_the_mapping_stays_usable():
    nbytes = 64 * MIB
    buf = alloc(nbytes, torch.device("cpu"))  # populated up front: resident now
    buf.fill_(7)
    before = _rss()
    assert drop_pages(buf[MIB:2 * MIB]) == nbytes  # the whole storage, whatever view is given
    assert before - _rss() >= nbytes - MIB  # back to the kernel (RSS may move a little meanwhile)
    assert int(buf.sum()) == 0  # reads as fresh zero pages
    buf[5] = 9  # a late write faults a page in: no crash, no other memory touched
    assert int(buf.sum()) == 9


def test_a_tensor_smaller_than_a_page_gives_nothing_back():
    assert drop_pages(torch.ones(16)) == 0
