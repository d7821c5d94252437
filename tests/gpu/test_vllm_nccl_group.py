"""The CUDA side of vLLM's RL routes (issue 40): a worker's NCCL group on a unique id another program
minted (weight_sync/vllm/nccl_comm.py), joined through vLLM's rendezvous (weight_sync/vllm/group.py), and
vLLM's own NCCL trainer pushing into the sidecar. `python -m pytest -m gpu tests/gpu`; NCCL holds one
rank per GPU, so all but the first need two."""

import base64
import concurrent.futures
import datetime

import pytest
import torch

from tests.procs import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
_VLLM_CLASS = b"vllm.distributed.device_communicators.pynccl_wrapper"


def _vllm_pickle(raw: bytes) -> bytes:
    """What vLLM's StatelessProcessGroup.broadcast_obj stores for its ncclUniqueId (protocol 4, no
    frame), written out so that this test needs no vLLM: the same opcodes `pickletools.dis` shows."""
    return (b"\x80\x04\x8c\x07_ctypes\x94\x8c\t_unpickle\x94\x93\x94\x8c" + bytes([len(_VLLM_CLASS)]) + _VLLM_CLASS
            + b"\x94\x8c\x0cncclUniqueId\x94\x93\x94}\x94C\x80" + raw + b"\x94\x86\x94\x86\x94R\x94.")


def test_one_rank_broadcasts_reduces_and_aborts():
    from weight_sync.vllm.nccl_comm import NcclComm, NcclError, new_unique_id

    comm = NcclComm(new_unique_id(), 0, 1, torch.device("cuda:0"), timeout_s=30)
    t = torch.arange(1000, device="cuda:0", dtype=torch.uint8)
    comm.broadcast(t)
    x = torch.full((7,), 2.5, device="cuda:0")
    comm.all_reduce(x)
    comm.wait("one rank's work")
    assert torch.equal(t.cpu(), torch.arange(1000, dtype=torch.uint8)) and torch.equal(x.cpu(), torch.full((7,), 2.5))
    with pytest.raises(NcclError, match="contiguous"):
        comm.broadcast(t.cpu())
    comm.abort()
    with pytest.raises(NcclError, match="aborted"):
        comm.broadcast(t)


def test_a_cpu_worker_refuses_an_nccl_id_by_name():
    from weight_sync.common.group import GroupError
    from weight_sync.vllm.group import VllmTrainerGroup

    with pytest.raises(GroupError, match="needs workers on CUDA"):
        VllmTrainerGroup(None, None, 2, 1, 5, "cpu", base64.b64encode(bytes(128)).decode())


@two_gpus
@pytest.mark.parametrize("form", ["store", "b64"])
def test_a_worker_joins_a_vllm_trainers_nccl_group_and_receives_chunks(form):
    """The trainer's side as vLLM's does it (rank 0 on cuda:0: its id pickled into its TCPStore, or
    sent as base64; the warm-up all-reduce; a uint8 broadcast per chunk); the worker on cuda:1."""
    from torch.distributed import TCPStore

    from weight_sync.vllm.group import VllmTrainerGroup
    from weight_sync.vllm.nccl_comm import NcclComm, new_unique_id

    uid, port = new_unique_id(), free_port()
    b64 = base64.b64encode(uid).decode() if form == "b64" else None
    store = None
    if form == "store":
        store = TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=60), wait_for_workers=False)
        store.set("broadcast_from/0/0", _vllm_pickle(uid))
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0") for n in (1 << 20, 17, 3 << 20)]

    def trainer() -> None:
        comm = NcclComm(uid, 0, 2, torch.device("cuda:0"), timeout_s=60)
        comm.all_reduce(torch.zeros(1, device="cuda:0"))
        for c in chunks:
            comm.broadcast(c)
        comm.wait("the trainer's chunks")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(trainer)
        group = VllmTrainerGroup("127.0.0.1" if store else None, port if store else None, 2, 1, 60,
                                 "cuda:1", b64)
        with torch.cuda.device(1):
            for i, c in enumerate(chunks):
                got = torch.empty(c.numel(), dtype=torch.uint8, device="cuda:1")
                group.receive(got, f"chunk {i}")
                assert torch.equal(got.cpu(), c.cpu())
        sent.result(timeout=60)
    group.close()
    assert not group.ready


@two_gpus
def test_a_dead_trainer_ends_the_workers_wait():
    """The trainer never sends its chunk (it aborts, as a killed one's NCCL peers see): the worker's
    receive fails with an error instead of waiting on, and its group is no longer ready."""
    from weight_sync.common.group import GroupError
    from weight_sync.vllm.group import VllmTrainerGroup
    from weight_sync.vllm.nccl_comm import NcclComm, new_unique_id

    uid = new_unique_id()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(lambda: NcclComm(uid, 0, 2, torch.device("cuda:0"), timeout_s=30))
        group = VllmTrainerGroup(None, None, 2, 1, 10, "cuda:1", base64.b64encode(uid).decode())
        trainer = joined.result(timeout=30)
    trainer.all_reduce(torch.zeros(1, device="cuda:0"))
    trainer.wait("warm-up")
    trainer.abort()
    with torch.cuda.device(1), pytest.raises(GroupError):
        group.receive(torch.empty(1 << 20, dtype=torch.uint8, device="cuda:1"), "a chunk that never comes")
    assert not group.ready


@two_gpus
def test_vllms_nccl_trainer_pushes_into_a_sidecar_on_cuda(qwen2_dir):
    """vLLM's own trainer API on cuda:0 (NCCLWeightTransferEngine via WeightTransferTrainerFactory,
    HTTPVLLMWeightSyncClient, ModuleSource), our engine on cuda:1: the sidecar then serves exactly
    the trainer's weights."""
    pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    import httpx
    from rollout import RolloutClient
    from tests.rollout.sidecar import Sidecar
    from weight_sync import weights_checksum

    side = Sidecar(qwen2_dir, "--http-port", "0", "--weight-transfer-routes", "--device", "cuda:1", token="")
    try:
        torch.cuda.set_device(0)
        model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).to("cuda:0")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        world = 1 + httpx.get(side.http_url + "/get_world_size", timeout=30).json()["world_size"]
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=world,
                                   packed=True, packed_buffer_size_bytes=8 << 20)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(side.http_url),
                                                           source=ModuleSource(model))
        engine.send_weights()
        client = RolloutClient(side.url)
        try:
            assert client.weights_checksums() == [weights_checksum(model.named_parameters())]
        finally:
            client.close()
    finally:
        side.stop()
