"""The records of a W&B offline run file (``run-<id>.wandb``), parsed by wandb's own protobuf schema
(``wandb.proto.wandb_internal_pb2.Record``).

wandb 0.31 ships no Python reader for these files (the Go core writes them; its datastore reader left the
Python package), so this walks the container by hand: a 7-byte header (``:W&B``, magic 0xBEE1, version 0),
then LevelDB's log format — 32 KiB blocks of records, each ``crc32c (4) · length (2, LE) · type (1)``
(1 full, 2 first, 3 middle, 4 last; a block tail under 7 bytes is padding) — whose payloads are Records."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B" or struct.unpack("<H", data[4:6])[0] != 0xBEE1:
        raise ValueError("not a W&B run file (no :W&B header)")
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # padding at a block's end
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        body = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # zero fill
            continue
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE:
            parts.append(body)
        elif kind == LAST:
            yield b"".join(parts + [body])


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    for payload in payloads(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def history(path: Path) -> dict[int, dict[str, object]]:
    """step → {key: value} of every ``run.log`` (values JSON-decoded; tables and images as their file refs)."""
    out: dict[int, dict[str, object]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out.setdefault(int(record.history.step.num), {}).update(row)
    return out


def config(path: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = record.config.update if kind == "config" else record.run.config.update if kind == "run" else []
        for item in updates:  # the run record carries wandb.init's config; config records later changes
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def summary(path: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
