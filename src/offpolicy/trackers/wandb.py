"""Weights & Biases, offline by default: ``WANDB_MODE=offline`` (unless set), files under ``<run>/wandb``
unless ``WANDB_DIR`` is set (then under ``$WANDB_DIR/wandb``, W&B's convention; trackers.json names the
directory either way; ``wandb sync <run>/wandb/offline-run-*`` uploads them later). Scalars by ``wandb.log(step=)``, the
samples and what-if tables as ``wandb.Table``, plots as ``wandb.Image``, the config as the run's config.

``close`` returns once the run's file (``run-<id>.wandb``) holds the run's exit record. ``run.finish()`` does not
wait for that: wandb-core (0.31) keeps the file's last 32 KiB block in memory and writes it when the run's stream
closes, which ``finish`` asks for without waiting for an answer (the service sends none). Measured (issue #67,
under a CPU hog on 2 cores): right after ``finish`` the file held only its 7-byte header in 9 of 20 runs of
``test_wandb_writes_where_wandb_dir_says`` (its ``KeyError: 0``), the whole run ~10 ms later; a run killed in
between, or a ``wandb sync`` started at once, lost its last steps. The file is read in its
own format (W&B's header, LevelDB's log of 32 KiB blocks, wandb's protobuf ``Record``); a file in a format this
does not know is not waited for."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Any

from offpolicy.trackers.runlog import RunLogTracker

WRITTEN_WITHIN_S = 60.0  # how long close() waits for W&B to write the run's exit record before it says so
_BLOCK, _HEADER = 32 * 1024, 7  # LevelDB's log: 32 KiB blocks, each record crc32c (4) · length (2) · type (1)


class WandbTracker(RunLogTracker):
    name = "wandb"

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        import wandb

        self.lib = wandb
        mode = os.environ.get("WANDB_MODE", "offline")
        # console="off": wandb would otherwise wrap stdout/stderr, under the progress bar; no system-stats
        # thread and no git/pip metadata (a training run is not a code snapshot)
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                                  disable_git=True, save_code=False)
        # W&B's own variable wins over the run directory, as WANDB_MODE and WANDB_PROJECT do
        directory = os.environ.get("WANDB_DIR") or str(run_dir)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "offpolicy"), name=name, dir=directory,
                              mode=mode, config=config, settings=settings, reinit="create_new")
        self.where = {"dir": str(Path(self.run.dir).parent), "mode": mode, "project": self.run.project,
                      "id": self.run.id}

    def log_summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self, failed: bool = False) -> None:
        path = None if self.run.disabled else Path(self.run.settings.sync_file)
        self.run.finish(exit_code=1 if failed else 0)
        if path is not None:
            wait_written(path, WRITTEN_WITHIN_S)


def wait_written(path: Path, within_s: float) -> None:
    """Return once ``path``, a W&B run file, holds the run's exit record (or is in a format not known here).

    Raises:
        TimeoutError: not written ``within_s`` seconds after the run finished (the error names the file).
    """
    deadline = time.monotonic() + within_s
    size = -1
    while True:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        if len(data) != size:  # written since the last look
            size = len(data)
            done = exit_written(data)
            if done is not False:  # True, or None: not a format known here
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"W&B had not written the run's end to {path} {within_s:g} s after run.finish() "
                               "(its last steps may be missing there)")
        time.sleep(0.01)


def exit_written(data: bytes) -> bool | None:
    """Whether ``data``, a W&B run file's bytes so far, holds an exit record: False while it does not (or holds
    less than its header), None for a header this does not know."""
    if len(data) < _HEADER:
        return False
    if data[:4] != b":W&B" or struct.unpack("<HB", data[4:7]) != (0xBEE1, 0):
        return None
    from wandb.proto import wandb_internal_pb2

    payloads, parts, pos = [], [], _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if pos + _HEADER + length > len(data):  # a record being written
            break
        body = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:  # whole
            payloads.append(body)
        elif kind == 2:  # first part
            parts = [body]
        elif kind == 3:  # middle
            parts.append(body)
        elif kind == 4:  # last
            payloads.append(b"".join(parts + [body]))
    record = wandb_internal_pb2.Record()
    for payload in reversed(payloads):  # from the end: the exit record is the last one the run writes
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "exit":
            return True
    return False


def open(run_dir: Path, name: str, config: dict[str, Any], start_step: int = 0) -> WandbTracker:  # noqa: A001
    return WandbTracker(run_dir, name, config)
