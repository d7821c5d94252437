"""Push directories, the file fallback for when no process group can be formed: a push as
safetensors plus its manifest in a directory (on a shared filesystem, or under /dev/shm on one
host). The trainer writes one (weight_sync/trainer/file_push.py), an engine's host copy is one
(weight_sync/engine_side/host_copy.py), and each worker validates one and loads it with
`load_weights_from_path` (all or nothing).

A push directory holds `weights.safetensors` and `manifest.json`. Both are written under temporary
names and renamed into place, the manifest last, so a reader never sees a half-written push: a
directory without `manifest.json` is not a push (yet). Write each version to its own directory
(e.g. `/dev/shm/ws/v{k}`) and delete old ones once every engine has loaded them.

An engine's host copy is the raw form instead (`link_raw`): `weights.raw`, a hard link to the
staging buffer the served weights live in, laid out as `manifest.json` says (the bytes of a push,
alignment padding included), and `digest`, the push's content digest, which a reader checks what
it read against (weight_sync/common/digest.py): no byte is copied to make it.
"""

from __future__ import annotations

import os

import torch

from weight_sync.common.manifest import DEFAULT_BUCKET_BYTES, DTYPES, Manifest, build_manifest, dtype_name

WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"
RAW_FILE = "weights.raw"  # the raw form: a push's layout as it lies in an engine's staging buffer
DIGEST_FILE = "digest"  # ... and the digest of those bytes (weight_sync/common/digest.py), when known


def write_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, version: int, ready=None) -> Manifest:
    """Write host tensors as a push directory (weights, then manifest.json: a reader that sees
    the manifest sees a whole push). `ready`: an event to wait for first (host_snapshot's)."""
    from safetensors.torch import save_file

    if ready is not None:
        ready.synchronize()
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    manifest = build_manifest([(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()], version,
                              DEFAULT_BUCKET_BYTES)
    tmp = os.path.join(path, f".{WEIGHTS_FILE}.tmp")
    save_file(tensors, tmp, metadata={"version": str(int(version)), "push_id": manifest.push_id})
    os.replace(tmp, os.path.join(path, WEIGHTS_FILE))
    _write_manifest(path, manifest)
    return manifest


def _write_manifest(path: str, manifest: Manifest) -> None:
    tmp = os.path.join(path, f".{MANIFEST_FILE}.tmp")
    with open(tmp, "wb") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST_FILE))


def link_raw(path: str | os.PathLike, file: str, manifest: Manifest, digest: int | None = None) -> None:
    """A push directory in the raw form over `file` (a buffer laid out as `manifest` says), linked,
    not copied; its manifest last, as `write_tensors` writes it."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    os.link(file, os.path.join(path, RAW_FILE))
    if digest is not None:
        with open(os.path.join(path, DIGEST_FILE), "w") as f:
            f.write(str(int(digest)))
    _write_manifest(path, manifest)


def withdraw(path: str | os.PathLike) -> None:
    """`path` is no push any more (its manifest goes first), and its link to a buffer goes: what
    an engine does before it writes the weights a host copy links in place."""
    path = os.fspath(path)
    for name in (MANIFEST_FILE, RAW_FILE):
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass


def read_raw(path: str | os.PathLike, m: Manifest) -> torch.Tensor | None:
    """A raw push directory's bytes (a read-only view of the file, `m.layout_bytes` long), or None
    when `path` holds the safetensors form. Raises ValueError if the file is shorter than `m`."""
    file = os.path.join(os.fspath(path), RAW_FILE)
    if not os.path.isfile(file):
        return None
    size = os.path.getsize(file)
    if size < m.layout_bytes:
        raise ValueError(f"{file} holds {size} bytes, its manifest lays out {m.layout_bytes}")
    if m.layout_bytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(file, shared=False, size=size, dtype=torch.uint8)[:m.layout_bytes]


def read_digest(path: str | os.PathLike) -> int | None:
    try:
        with open(os.path.join(os.fspath(path), DIGEST_FILE)) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None


def read_manifest(path: str | os.PathLike) -> Manifest:
    file = os.path.join(os.fspath(path), MANIFEST_FILE)
    try:
        with open(file, "rb") as f:
            return Manifest.from_wire(f.read().decode())
    except FileNotFoundError:
        raise ValueError(f"{path} holds no complete push: {MANIFEST_FILE} is missing") from None


def read_tensors(path: str | os.PathLike) -> list[tuple[str, torch.Tensor]]:
    """A push directory's tensors as (name, tensor) pairs in its manifest's order: what a sidecar
    sends on from its host copy (rollout.sidecar.peer_send)."""
    from safetensors import safe_open

    m = read_manifest(path)
    raw = read_raw(path, m)
    if raw is not None:
        return [(t.name, raw[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)) for t in m.tensors]
    with safe_open(os.path.join(os.fspath(path), WEIGHTS_FILE), framework="pt", device="cpu") as f:
        return [(t.name, f.get_tensor(t.name)) for t in m.tensors]


def checkpoint_as_push(path: str | os.PathLike, version: int, into: str | os.PathLike) -> str:
    """A push directory of the weights at `path`: `path` itself when it is one, else its safetensors
    files (an HF checkpoint directory, SGLang's `update_weights_from_disk`) written into `into`."""
    import glob

    from safetensors.torch import load_file

    path = os.fspath(path)
    if os.path.exists(os.path.join(path, MANIFEST_FILE)):
        return path
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors file and no {MANIFEST_FILE} in {path}")
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    write_tensors(tensors, into, version)
    return os.fspath(into)

