"""Read the history of an offline W&B run (``run-ID.wandb``) for the tests.

wandb 0.31 ships no Python reader for its transaction log (the Go ``wandb-core`` writes it), so
this is the format as wandb's former ``wandb/sdk/internal/datastore.py`` read it: a 7-byte file
header (``:W&B``, magic ``0xBEE1`` little-endian, version 0), then LevelDB-log records in 32 KiB
blocks, each a 7-byte header (CRC-32C, length uint16 LE, type: 1 full, 2 first, 3 middle,
4 last) and its payload; a block's tail shorter than a header is padding. Each assembled payload
is a ``wandb_internal_pb2.Record``, parsed with wandb's own protobuf class.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7


def records(path: str | Path) -> list[Any]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    out, pos, parts = [], 7, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # zero padding at the end of the file
            continue
        parts = payload if kind in (1, 2) else parts + payload
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(parts)
            out.append(rec)
    return out


def history(path: str | Path) -> list[dict[str, Any]]:
    """The logged rows, one dict per ``run.log`` call (wandb's ``_step`` etc. included)."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return rows
