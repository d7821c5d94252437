"""Devices, spelled one way, and where engines go: the one rule of placement.

`cuda` and `cuda:0` are the same GPU to CUDA but not to `==`; every comparison of devices in
weight sync goes through `normalize_device`. A weight-sync group on NCCL cannot hold two ranks
on one GPU (NCCL refuses "duplicate GPU" when the communicator forms, after the timeout on some
versions), so placement is checked before anything starts: the sidecar's engines by
`engine_devices`, the whole group (trainer included) by `duplicate_gpus` when it forms.
"""

from __future__ import annotations

import re
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ENGINE_DEVICE_TYPES = ("cpu", "cuda")  # what an engine runs on
_DEVICE = re.compile(r"([a-z]+)(?::(\d+))?")


def normalize_device(device: torch.device | str) -> torch.device:
    """`cuda` -> `cuda:<current device>`; everything else as torch spells it."""
    import torch  # here: the sidecar checks placement before it imports torch

    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return d


def engine_devices(device: str, num_engines: int, gpus: str | None = None, per_engine: int = 1) -> list[str]:
    """One device per engine, from the sidecar's flags:

    - `--device cpu`: every engine on the CPU;
    - `--device cuda --gpus 1,2`: engine i on `cuda:<gpus[i]>`;
    - `--device cuda:1,cuda:2`: engine i on the i-th device listed;
    - `--device cuda` alone: engine i on `cuda:i` (the first N GPUs this process sees).
    With `per_engine` N > 1 (vLLM's tensor parallelism) each engine takes the next N GPUs, spelt
    `cuda:a,b` (the GPUs its processes see). Raises ValueError when the count does not match or
    two ranks would share a GPU."""
    if num_engines < 1:
        raise ValueError(f"--num-engines must be >= 1, got {num_engines}")
    if per_engine > 1 and device_type(device.split(",")[0].strip()) == "cuda":
        try:
            gpus_each = engine_devices(device, num_engines * per_engine, gpus)
        except ValueError as e:
            raise ValueError(f"{num_engines} engines x {per_engine} tensor-parallel ranks take "
                             f"{num_engines * per_engine} GPUs, one each: {e}") from None
        return [f"cuda:{','.join(d.split(':')[1] for d in gpus_each[i * per_engine:(i + 1) * per_engine])}"
                for i in range(num_engines)]
    listed = [d.strip() for d in device.split(",") if d.strip()]
    if gpus is not None:
        if listed != ["cuda"]:
            raise ValueError(f"--gpus goes with --device cuda, not --device {device}")
        listed = [f"cuda:{int(g)}" for g in gpus.split(",") if g.strip()]
    elif listed == ["cuda"]:
        listed = [f"cuda:{i}" for i in range(num_engines)]
    types = [device_type(d) for d in listed]  # raises on a misspelt device
    if types == ["cpu"]:
        return listed * num_engines
    if len(listed) != num_engines:
        raise ValueError(f"{num_engines} engines but {len(listed)} devices ({', '.join(listed)}): give one device "
                         "per engine, e.g. --device cuda:1,cuda:2 or --device cuda --gpus 1,2")
    clash = sorted({d for d in listed if listed.count(d) > 1 and device_type(d) == "cuda"})
    if clash:
        raise ValueError(f"two engines on {', '.join(clash)}: the weight-sync group (NCCL) cannot hold two ranks "
                         "on one GPU; give each engine its own GPU")
    return listed


def device_type(spec: str) -> str:
    """"cpu", "cuda" of a device spelt `cpu`, `cuda` or `cuda:N` (torch's spelling, without
    importing torch); ValueError for anything else."""
    m = _DEVICE.fullmatch(spec)
    if m is None or m[1] not in ENGINE_DEVICE_TYPES or (m[1] == "cpu" and m[2] not in (None, "0")):
        raise ValueError(f"unknown device {spec!r}: an engine runs on cpu, cuda or cuda:N")
    return m[1]


def device_identity(device: torch.device) -> dict:
    """What tells this rank's device apart from every other rank's: the host, and for a GPU its
    UUID (indices differ between processes with different CUDA_VISIBLE_DEVICES)."""
    ident = {"host": socket.gethostname(), "device": str(device)}
    if device.type == "cuda":
        import torch

        ident["gpu"] = str(torch.cuda.get_device_properties(device).uuid)
    return ident


def duplicate_gpus(identities: dict[int, dict]) -> list[str]:
    """Problems with a group's placement: two ranks on one GPU (same host, same GPU UUID).
    `identities`: rank -> `device_identity(...)` of that rank."""
    seen: dict[tuple[str, str], int] = {}
    problems = []
    for rank in sorted(identities):
        ident = identities[rank]
        if "gpu" not in ident:
            continue
        key = (ident["host"], ident["gpu"])
        if key in seen:
            problems.append(f"ranks {seen[key]} and {rank} are both on GPU {ident['gpu']} ({ident['device']}) of host "
                            f"{ident['host']}: NCCL cannot hold two ranks of one group on one GPU (colocated trainer "
                            "and engine: give the engine another GPU)")
        else:
            seen[key] = rank
    return problems
