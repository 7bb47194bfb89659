"""Weights & Biases, offline by default: ``WANDB_MODE=offline`` (unless set), files under ``<run>/wandb``
unless ``WANDB_DIR`` is set (then under ``$WANDB_DIR/wandb``, W&B's convention; trackers.json names the
directory either way; ``wandb sync <run>/wandb/offline-run-*`` uploads them later). Scalars by ``wandb.log(step=)``, the
samples and what-if tables as ``wandb.Table``, plots as ``wandb.Image``, the config as the run's config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from offpolicy.trackers.runlog import RunLogTracker


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
        self.run.finish(exit_code=1 if failed else 0)


def open(run_dir: Path, name: str, config: dict[str, Any], start_step: int = 0) -> WandbTracker:  # noqa: A001
    return WandbTracker(run_dir, name, config)
