"""Host copies on the CPU (weight_sync/engine_side/host_copy.py): a background write reads the served
weights themselves, so what writes memory that held them waits for it (`wait_readers`), and the copy
written is the version it names, whole."""

import torch

from weight_sync.common.push_dir import read_manifest, read_tensors
from weight_sync.engine_side.host_copy import HostCopies
from weight_sync.engine_side.staging_memory import whole


def test_a_background_write_reads_the_served_weights_and_whoever_rewrites_them_waits(tmp_path):
    buffer = torch.arange(1 << 22, dtype=torch.float32)  # 16 MB: one staging buffer's weights
    served = [("a", buffer[:1 << 21].view(1024, 2048)), ("b", buffer[1 << 21:])]
    expected = {n: t.clone() for n, t in served}
    other = torch.zeros(8)
    copies = HostCopies()
    done = copies.save(served, str(tmp_path / "v3"), 3, background=True)
    copies.wait_readers(other)  # another storage: no wait needed, none made
    copies.wait_readers(whole(buffer))  # a push about to take this buffer as its staging
    assert done.done()
    buffer.fill_(-1.0)  # the next push's bytes land in it
    assert read_manifest(tmp_path / "v3").version == 3
    got = dict(read_tensors(tmp_path / "v3"))
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert copies.saved(str(tmp_path / "v3"))["bytes"] == buffer.numel() * 4


def test_a_write_in_the_foreground_leaves_no_reader(tmp_path):
    copies = HostCopies()
    out = copies.save([("w", torch.ones(4))], str(tmp_path / "v1"), 1)
    assert out["bytes"] == 16 and copies.readers == []
