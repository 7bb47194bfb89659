"""Trackio's local SQLite store, in ``<run>/trackio`` unless ``TRACKIO_DIR`` is set (``trackio show
--project offpolicy`` with the same ``TRACKIO_DIR`` reads it). Trackio fixes its directory when it is first
imported: a second run in the same Python process writes where the first one did (trackers.json says where).
Scalars by ``trackio.log(step=)``, tables as ``trackio.Table``, plots as ``trackio.Image``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from offpolicy.trackers import redacted_stdout
from offpolicy.trackers.runlog import RunLogTracker

PROJECT = "offpolicy"


class TrackioTracker(RunLogTracker):
    name = "trackio"

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        if "trackio" not in sys.modules and not os.environ.get("TRACKIO_DIR"):
            os.environ["TRACKIO_DIR"] = str((run_dir / "trackio").resolve())
        import trackio
        from trackio import utils

        self.lib = trackio
        project = os.environ.get("TRACKIO_PROJECT", PROJECT)
        # embed=False: no browser, no server; auto_log_*: no system-metrics thread. It prints where it logs
        # (a TRACKIO_SERVER_URL too): redacted
        with redacted_stdout():
            self.run = trackio.init(project=project, name=name, config=config, embed=False, auto_log_gpu=False,
                                    auto_log_cpu=False)
        # the run's id too: a store outside the run directory may hold other runs of the same name
        self.where = {"dir": str(utils.TRACKIO_DIR), "project": project, "run": self.run.name, "run_id": self.run.id}

    def log_summary(self, values: dict[str, float]) -> None:
        self.run.log({f"summary/{k}": v for k, v in values.items()}, step=0)

    def close(self, failed: bool = False) -> None:
        self.run.finish()


def open(run_dir: Path, name: str, config: dict[str, Any], start_step: int = 0) -> TrackioTracker:  # noqa: A001
    return TrackioTracker(run_dir, name, config)
