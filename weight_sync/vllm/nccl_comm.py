"""An NCCL communicator on a unique id another program minted: the group of a trainer written for
vLLM's RL routes, on CUDA (weight_sync/vllm/group.py). torch's ProcessGroupNCCL always mints and
trades its own id through its store, so it cannot join vLLM's `PyNcclCommunicator`; this calls
NCCL's C API through ctypes instead, the few functions that group uses (as vLLM's
pynccl_wrapper does): init on the id, broadcast, all-reduce, abort.

The library is the one torch's CUDA build loaded (`libnccl.so.2` by soname), or `NCCL_LIBRARY` /
vLLM's `VLLM_NCCL_SO_PATH` where set.

Faults: NCCL's calls only enqueue; `wait` polls the stream's event and the communicator's async
error, so a peer that dies (NCCL sees its sockets close) or hangs (the timeout) ends the wait with
an error and an aborted communicator instead of a thread blocked for good. `ncclCommInitRank`
itself blocks until every rank joined, so it runs on a thread of its own under the same timeout;
one that never returns stays parked there (NCCL has no way to stop it before a handle exists).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time

import torch

NCCL_SUCCESS, NCCL_IN_PROGRESS = 0, 7
_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
           torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_SUM = 0


class NcclError(RuntimeError):
    pass


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def library_path() -> str:
    return os.environ.get("NCCL_LIBRARY") or os.environ.get("VLLM_NCCL_SO_PATH") or "libnccl.so.2"


@functools.cache
def _lib() -> ctypes.CDLL:
    if torch.version.cuda is None:
        raise NcclError(f"this torch build ({torch.__version__}) has no CUDA, so no NCCL")
    try:
        lib = ctypes.CDLL(library_path())
    except OSError as e:
        raise NcclError(f"cannot load NCCL ({library_path()}): {e}; set NCCL_LIBRARY to libnccl.so.2's path") from e
    vp, i, res = ctypes.c_void_p, ctypes.c_int, ctypes.c_int
    for name, args in (("ncclGetUniqueId", [ctypes.POINTER(_UniqueId)]),
                       ("ncclCommInitRank", [ctypes.POINTER(vp), i, _UniqueId, i]),
                       ("ncclBroadcast", [vp, vp, ctypes.c_size_t, i, i, vp, vp]),
                       ("ncclAllReduce", [vp, vp, ctypes.c_size_t, i, i, vp, vp]),
                       ("ncclCommGetAsyncError", [vp, ctypes.POINTER(res)]),
                       ("ncclCommAbort", [vp])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    lib.ncclGetErrorString.restype, lib.ncclGetErrorString.argtypes = ctypes.c_char_p, [res]
    return lib


def _check(result: int, what: str) -> None:
    if result != NCCL_SUCCESS:
        raise NcclError(f"{what}: {_lib().ncclGetErrorString(result).decode()} (ncclResult {result})")


def new_unique_id() -> bytes:
    """A fresh id (what a group's rank 0 mints and hands the others)."""
    uid = _UniqueId()
    _check(_lib().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid)


class NcclComm:
    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: torch.device, timeout_s: float):
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, torch.device(device), timeout_s
        self._lock = threading.Lock()
        self.aborted = False
        self.comm = self._init(unique_id)

    def _init(self, unique_id: bytes) -> ctypes.c_void_p:
        uid = _UniqueId.from_buffer_copy(unique_id)
        comm, out = ctypes.c_void_p(), {}

        def init() -> None:
            try:
                with torch.cuda.device(self.device):
                    out["result"] = _lib().ncclCommInitRank(ctypes.byref(comm), self.world_size, uid, self.rank)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                out["error"] = e

        t = threading.Thread(target=init, name="nccl-init", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            raise NcclError(f"rank {self.rank} of {self.world_size}: the other ranks did not join within "
                            f"{self.timeout_s}s (ncclCommInitRank)")
        if "error" in out:
            raise NcclError(f"rank {self.rank}: {out['error']}")
        _check(out["result"], f"ncclCommInitRank (rank {self.rank} of {self.world_size})")
        return comm

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def _dtype(self, t: torch.Tensor) -> int:
        if t.device != self.device or not t.is_contiguous() or t.dtype not in _DTYPES:
            raise NcclError(f"NCCL takes contiguous tensors on {self.device} of {sorted(map(str, _DTYPES))}: "
                            f"got {t.dtype} on {t.device}")
        return _DTYPES[t.dtype]

    def broadcast(self, t: torch.Tensor, root: int = 0) -> None:
        """Enqueue `t` from `root` into every rank's `t` on this thread's current stream."""
        if self.aborted:
            raise NcclError("the communicator was aborted")
        p = ctypes.c_void_p(t.data_ptr())
        _check(_lib().ncclBroadcast(p, p, t.numel(), self._dtype(t), root, self.comm, self._stream()),
               "ncclBroadcast")

    def all_reduce(self, t: torch.Tensor) -> None:
        """Enqueue a sum of `t` over every rank, in place."""
        if self.aborted:
            raise NcclError("the communicator was aborted")
        p = ctypes.c_void_p(t.data_ptr())
        _check(_lib().ncclAllReduce(p, p, t.numel(), self._dtype(t), _SUM, self.comm, self._stream()),
               "ncclAllReduce")

    def wait(self, what: str) -> None:
        """Until this thread's stream has done what was enqueued, or fail: a peer's error or death
        (NCCL's async error), an abort from another thread, or the timeout (then this aborts)."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            error = ctypes.c_int(NCCL_SUCCESS)
            with self._lock:  # never on a communicator another thread has just aborted (freed)
                if not self.aborted:
                    _lib().ncclCommGetAsyncError(self.comm, ctypes.byref(error))
            if self.aborted or error.value not in (NCCL_SUCCESS, NCCL_IN_PROGRESS) or time.monotonic() > deadline:
                why = ("aborted" if self.aborted else f"timed out after {self.timeout_s}s"
                       if error.value in (NCCL_SUCCESS, NCCL_IN_PROGRESS)
                       else _lib().ncclGetErrorString(error.value).decode())
                self.abort()
                raise NcclError(f"{what} on rank {self.rank}: {why}")
            time.sleep(0.001)

    def abort(self) -> None:
        """Stop the communicator from any thread, never waiting for a peer: its kernels end, and
        nothing new can be enqueued on it."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
            _lib().ncclCommAbort(self.comm)
