"""A training run's pushes share one layout (weight_sync/trainer/sender.py): between two pushes no
weight changes name, dtype or shape, so the sender keeps the last push's manifest and gives the
next one a new version and push id on the same layout, without walking the model first."""

from __future__ import annotations

import uuid

import msgspec

from weight_sync.common.manifest import Manifest, build_manifest


def versioned(manifest: Manifest, version: int) -> Manifest:
    """`manifest`'s layout as a new push of `version`."""
    return msgspec.structs.replace(manifest, version=int(version), push_id=uuid.uuid4().hex)


def layout_for(last: tuple | None, specs: list, bucket_bytes: int, version: int) -> tuple[Manifest, tuple]:
    """build_manifest, reusing the layout of `last` ((specs, bucket_bytes), manifest) when names,
    dtypes, shapes and bucket size are unchanged; returns the manifest and what to keep as last."""
    key = (specs, bucket_bytes)
    if last is not None and last[0] == key:
        return versioned(last[1], version), last
    manifest = build_manifest(specs, version, bucket_bytes)
    return manifest, (key, manifest)
