"""What W&B and Trackio share: Trackio mirrors W&B's API (``run.log(step=)``, ``Table``, ``Image``), so
scalars, tables and images go through one ``run.log`` call each for both."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class RunLogTracker:
    """``self.lib`` is the tracker's module (its ``Table`` and ``Image``), ``self.run`` its run (``log``)."""

    lib: Any
    run: Any

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({key: self.lib.Table(columns=columns, data=rows)}, step=step)

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        self.run.log({key: self.lib.Image(str(path)) for key, path in images.items()}, step=step)
