"""Reading a W&B offline run's transaction log (``run-<id>.wandb``) back, as ``wandb sync`` does.

wandb 0.31 keeps its reader in the Go ``wandb-core`` binary only (the Python ``datastore`` module
is gone), so this reads the file's framing here: a 7-byte header (``:W&B``, magic ``0xBEE1``,
version 0), then LevelDB-log records in 32 KiB blocks (CRC-32 of type and data, 2-byte length,
type FULL/FIRST/MIDDLE/LAST), each payload one ``wandb.proto.wandb_internal_pb2.Record``, parsed
with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

_HEADER = b":W&B\xe1\xbe\x00"
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every ``Record`` of the log at ``path``, in order; raises ValueError on a bad header or CRC."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if not data.startswith(_HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    out, partial, pos = [], b"", len(_HEADER)
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad checksum at byte {pos}")
        pos += 7 + length
        if kind == _FULL:
            payloads = [chunk]
        elif kind == _FIRST:
            partial, payloads = chunk, []
        elif kind == _MIDDLE:
            partial, payloads = partial + chunk, []
        else:
            payloads, partial = [partial + chunk], b""
        for payload in payloads:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            out.append(record)
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """The run's logged rows (``run.log``), each ``{key: value}`` with ``_step`` among them."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def config(path: Path) -> dict[str, Any]:
    """The run's config as ``wandb.init(config=...)`` and later ``config.update`` set it."""
    out: dict[str, Any] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else ()
        for item in items:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    out.pop("_wandb", None)
    return out
