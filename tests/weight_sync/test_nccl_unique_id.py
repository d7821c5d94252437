"""The NCCL unique id a trainer written for vLLM's RL routes publishes (weight_sync/vllm/nccl_unique_id.py):
read from vLLM's own pickle through vLLM's own StatelessProcessGroup rendezvous, and nothing else
unpickled. NCCL itself is CUDA's: tests/gpu/test_vllm_nccl_group.py."""

import base64
import datetime
import os
import pickle
import socket
import threading

import pytest

from weight_sync.vllm import nccl_unique_id

vllm_wrapper = pytest.importorskip("vllm.distributed.device_communicators.pynccl_wrapper")

ID = bytes((i * 37 + 11) % 256 for i in range(128))


def _vllm_id(raw: bytes = ID):
    uid = vllm_wrapper.ncclUniqueId()
    for i, b in enumerate(raw):
        uid.internal[i] = b - 256 if b > 127 else b  # c_byte is signed
    return uid


def test_vllms_pickled_id_gives_its_bytes():
    assert nccl_unique_id.from_pickle(pickle.dumps(_vllm_id())) == ID
    assert nccl_unique_id.from_pickle(pickle.dumps(_vllm_id(), protocol=pickle.HIGHEST_PROTOCOL)) == ID


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/nccl-id-pwned",))


@pytest.mark.parametrize("value", [_Payload(), {"id": ID}, ID, [ID], bytearray(ID)])
def test_anything_else_is_refused_and_runs_nothing(value):
    with pytest.raises(ValueError, match="refused"):
        nccl_unique_id.from_pickle(pickle.dumps(value))
    assert not os.path.exists("/tmp/nccl-id-pwned")


def test_a_short_id_and_garbage_are_refused():
    short = pickle.dumps(_vllm_id()).replace(b"C\x80", b"C\x10", 1)[:-1]  # a cut pickle
    for data in (short, b"", b"\x80\x04junk"):
        with pytest.raises(ValueError):
            nccl_unique_id.from_pickle(data)


def test_the_b64_form():
    assert nccl_unique_id.from_b64(base64.b64encode(ID).decode()) == ID
    with pytest.raises(ValueError, match="128 bytes"):
        nccl_unique_id.from_b64(base64.b64encode(ID[:100]).decode())
    with pytest.raises(ValueError, match="base64"):
        nccl_unique_id.from_b64(base64.urlsafe_b64encode(b"\xff" * 128).decode())  # '-' and '_' are not standard


def test_the_id_through_vllms_own_rendezvous():
    """vLLM's trainer side (StatelessProcessGroup.create as rank 0, then PyNcclCommunicator's
    broadcast_obj of its id) and a worker's end as ours joins it: a TCPStore client, the id read."""
    from torch.distributed import TCPStore
    from vllm.distributed.utils import StatelessProcessGroup

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = {}

    def rank0():
        trainer["pg"] = pg = StatelessProcessGroup.create("127.0.0.1", port, rank=0, world_size=2, store_timeout=30)
        pg.broadcast_obj(_vllm_id(), src=0)

    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    store = TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=30))
    assert nccl_unique_id.read_from_store(store) == ID
    t.join(30)
    assert not t.is_alive()
