"""The NCCL unique id of a trainer written for vLLM's RL routes, read without unpickling anything
else (issue 40 item 2).

On CUDA, vLLM's trainer forms its group with `StatelessProcessGroup` + `PyNcclCommunicator`: rank 0
mints the id (`ncclGetUniqueId`) and publishes `pickle.dumps(ncclUniqueId)` in its TCPStore under
`broadcast_from/0/0`, and each of vLLM's workers `pickle.loads` it. That pickle names two globals,
`_ctypes._unpickle` and vLLM's `ncclUniqueId` class, and carries the id's 128 bytes. The unpickler
here resolves exactly those two names, to stand-ins that hand back the bytes, and refuses every
other global: a store that lies cannot make this process run anything. (Python's own advice for
untrusted pickles: "Restricting Globals" in the `pickle` docs.)

The other form a trainer may send, `nccl_unique_id_b64`, is standard base64 of the same bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle

UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
STORE_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj's first object from rank 0
_VLLM_ID_CLASS = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")


class _IdClass:
    """Stands in for vLLM's ncclUniqueId: only ever passed to `_unpickle` below."""


class _IdBytes(bytes):
    """Bytes that came out of an ncclUniqueId (a pickle of plain bytes is not an id)."""


def _unpickle(cls, state):
    """Stands in for `_ctypes._unpickle(type, (instance dict, raw bytes))`: gives back the bytes."""
    if cls is not _IdClass or not (isinstance(state, tuple) and len(state) == 2 and state[0] == {}
                                   and isinstance(state[1], bytes)):
        raise pickle.UnpicklingError("not a ctypes ncclUniqueId")
    return _IdBytes(state[1])


class _OnlyTheId(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("_ctypes", "_unpickle"):
            return _unpickle
        if (module, name) == _VLLM_ID_CLASS:
            return _IdClass
        raise pickle.UnpicklingError(f"it names {module}.{name}; only vLLM's ncclUniqueId is accepted")


def _checked(raw, what: str) -> bytes:
    if not isinstance(raw, bytes) or len(raw) != UNIQUE_ID_BYTES:
        size = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise ValueError(f"{what} is not an NCCL unique id ({UNIQUE_ID_BYTES} bytes): got {size}")
    return raw


def from_pickle(data: bytes) -> bytes:
    """The id's 128 bytes from vLLM's pickled `ncclUniqueId`; ValueError for anything else."""
    try:
        raw = _OnlyTheId(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - a malformed pickle raises many kinds; all mean "refused"
        raise ValueError(f"the trainer's NCCL unique id was refused: {e}") from None
    if not isinstance(raw, _IdBytes):
        raise ValueError(f"the trainer's NCCL unique id was refused: a pickled {type(raw).__name__}, not an "
                         "ncclUniqueId")
    return bytes(_checked(raw, "the trainer's pickled NCCL unique id"))


def from_b64(text: str) -> bytes:
    """`init_info.nccl_unique_id_b64`: standard (not URL-safe) base64 of the id's bytes."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"nccl_unique_id_b64 is not standard base64: {e}") from None
    return _checked(raw, "nccl_unique_id_b64")


def read_from_store(store) -> bytes:
    """Wait (the store's timeout) for rank 0's id in a vLLM trainer's TCPStore, and read it."""
    return from_pickle(store.get(STORE_KEY))
