"""Read what a wandb run logged from its offline run file (`run-*.wandb`): a LevelDB-style log
of protobuf records (wandb's own reader moved into its Go core, so the tests carry this one)."""

import json
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32768  # records never straddle a block's last 6 bytes
_FULL, _FIRST, _LAST = 1, 2, 4


def records(path: Path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, buf = 7, b""  # header: magic, 0xBEE1, version
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (_FULL, _FIRST) else buf + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def history(path: Path) -> list[dict]:
    """One dict per `run.log(...)`, with `_step`."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]
