"""Readers of what the trackers wrote, with their own formats and protobufs (no network,
no tensorboard package: its protobuf pin conflicts with pulumi-policy's)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any


def wandb_records(path: Path) -> list[bytes]:
    """The records of a .wandb file: W&B's LevelDB-style log (a 7-byte file header, then
    32 KiB blocks of records, each `crc32c:4, length:2, type:1` + data; a record cut at a
    block end continues as FIRST/MIDDLE/LAST pieces)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, pos, part = [], 7, b""
    block = 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left  # block trailer padding
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            out.append(part + chunk)
    return out


def wandb_history(folder: Path) -> list[dict[str, Any]]:
    """The history rows of one offline run folder, parsed with W&B's own protobufs."""
    import json

    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("*.wandb")
    rows = []
    for data in wandb_records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def tb_events(folder: Path) -> dict[str, list[Any]]:
    """Every event of every event file (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[Any]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, events, i = path.read_bytes(), [], 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            ev = event_pb2.Event()
            ev.ParseFromString(data[i + 12 : i + 12 + n])
            events.append(ev)
            i += 12 + n + 4
        out[path.name] = events
    return out
