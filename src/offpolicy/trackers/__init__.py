"""Experiment trackers: ``log_to=[tensorboard, wandb, mlflow, trackio]`` (``metrics.jsonl`` is always written).

One small protocol (``Tracker``), one adapter module per tracker (``tensorboard.py``, ``wandb.py``,
``mlflow.py``, ``trackio.py``), each imported only when named, so a tracker that is not installed costs
nothing. Every tracker receives, under the names ``metrics.jsonl`` uses:

* the run's config, once (``log_config``);
* each step's finite scalars (``log_metrics``; a NaN, written as null to metrics.jsonl, is left out);
* tables of rows (``log_table``): the saved samples of a step (prompt, completion, reward, mean/max |log ρ|),
  diagnose's what-if table;
* PNG plots (``log_images``) and, for diagnose, a flat summary (``log_summary``).

Offline by default: W&B in ``WANDB_MODE=offline`` under ``<run>/wandb``, MLflow's file store
``<run>/mlruns``, Trackio's SQLite store ``<run>/trackio`` (each unless its own environment variable says
otherwise: ``WANDB_MODE``, ``MLFLOW_TRACKING_URI``, ``TRACKIO_DIR``). Where each one wrote goes to
``<run>/trackers.json``.

Failures never stop a run: a tracker that is missing or fails to start is one line before training
(``open_trackers``), and one that fails mid-run is reported once and left out from then on
(``Trackers``); ``metrics.jsonl`` and the other trackers go on.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.text import Text

NAMES = ("tensorboard", "wandb", "mlflow", "trackio")
# the pip extra that installs each one (pyproject's optional-dependencies)
EXTRAS = {"tensorboard": "train", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
SAMPLE_COLUMNS = ["step", "prompt", "completion", "answer", "reward", "advantage", "tokens", "finished",
                  "outside_support", "abs_log_ratio_mean", "abs_log_ratio_max"]


class Tracker(Protocol):
    """What ``RunLogger`` and ``diagnose`` hand each tracker. ``open(run_dir, name, config)`` (a module-level
    function of each adapter) starts it; every method may raise — ``Trackers`` catches it."""

    name: str
    where: dict[str, Any]  # where it wrote (trackers.json): directory, URI, project, run id

    def log_metrics(self, step: int, values: dict[str, float]) -> None: ...

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list[Any]]) -> None: ...

    def log_images(self, step: int, images: dict[str, Path]) -> None: ...

    def log_summary(self, values: dict[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def finite_scalars(values: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``values`` a tracker stores: ints and finite floats (bools as 0/1), nothing else."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (lists kept as their JSON text): for trackers whose config
    is flat (MLflow's params)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else value
    return out


def sample_rows(step: int, samples: list[dict[str, Any]]) -> list[list[Any]]:
    """``samples.jsonl`` records as table rows in ``SAMPLE_COLUMNS`` order."""
    return [[step if c == "step" else r.get(c) for c in SAMPLE_COLUMNS] for r in samples]


def parse_log_to(value: str | Sequence[str] | None) -> list[str]:
    """``"wandb,mlflow"`` or a list → checked names (duplicates dropped, order kept).

    Raises:
        ValueError: an unknown tracker name (the message lists the known ones).
    """
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    names = []
    for item in (str(i).strip().lower() for i in items):
        if not item or item == "none":
            continue
        if item not in NAMES:
            raise ValueError(f"log_to: unknown tracker {item!r}; known: {', '.join(NAMES)} (metrics.jsonl is always "
                             "written)")
        if item not in names:
            names.append(item)
    return names


class Trackers:
    """The open trackers, each call fanned out and guarded: a tracker that raises is reported once (one
    line naming it, what it was doing and the error) and left out for the rest of the run."""

    def __init__(self, trackers: list[Tracker], console: Console, run_dir: Path | None = None):
        self.trackers = trackers
        self.console = console
        self.where = {t.name: t.where for t in trackers}  # kept after close: the run's last line says where
        if run_dir is not None and trackers:
            (run_dir / "trackers.json").write_text(json.dumps(self.where, indent=1, default=str))

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def places(self) -> dict[str, str]:
        """Each tracker's store, as the console names it: its directory, log directory or tracking URI."""
        return {name: where.get("dir") or where.get("logdir") or where.get("tracking_uri")
                for name, where in self.where.items()}

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as err:  # noqa: BLE001 - a tracker never stops the run
                self.trackers.remove(tracker)
                self.console.print(Text(f"log_to: {tracker.name} failed while {what} ({type(err).__name__}: "
                                        f"{_first_line(err)}); it is off for the rest of this run, metrics.jsonl "
                                        "and the other trackers go on", style="yellow"), soft_wrap=True)
                try:
                    tracker.close(failed=True)
                except Exception:  # noqa: BLE001 - already reported
                    pass

    def log_metrics(self, step: int, values: dict[str, Any]) -> None:
        scalars = finite_scalars(values)
        self._each(f"logging step {step}'s metrics", lambda t: t.log_metrics(step, scalars))

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        # a NaN cell (a preset that rejects every token has no weights) as null, as metrics.jsonl writes it:
        # the trackers would otherwise store it three ways (NaN, null, the string "NaN")
        rows = [[None if isinstance(v, float) and not math.isfinite(v) else v for v in row] for row in rows]
        self._each(f"logging the table {key!r}", lambda t: t.log_table(key, step, columns, rows))

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        self.log_table("samples", step, SAMPLE_COLUMNS, sample_rows(step, samples))

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        self._each("logging the plots", lambda t: t.log_images(step, images))

    def log_summary(self, values: dict[str, Any]) -> None:
        scalars = finite_scalars(values)
        self._each("logging the summary", lambda t: t.log_summary(scalars))

    def close(self, failed: bool = False) -> None:
        self._each("closing", lambda t: t.close(failed=failed))
        self.trackers = []


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"


def open_trackers(names: Sequence[str], run_dir: Path, name: str, config: dict[str, Any],
                  console: Console | None = None, start_step: int = 0) -> Trackers:
    """Start each named tracker into ``run_dir`` with ``config``. A tracker whose package is missing, or
    that fails to start, is one line on ``console`` — with the fix — and the run goes on without it."""
    console = console or Console()
    opened = []
    for tracker_name in names:
        module = importlib.import_module(f"offpolicy.trackers.{tracker_name}")
        try:
            opened.append(module.open(run_dir, name, config, start_step=start_step))
        except ImportError as err:
            console.print(Text(f"log_to: {tracker_name} is not installed ({_first_line(err)}); this run goes on "
                               f"without it. Fix: pip install 'offpolicy[{EXTRAS[tracker_name]}]'", style="yellow"),
                          soft_wrap=True)
        except Exception as err:  # noqa: BLE001 - a tracker that cannot start never stops the run
            console.print(Text(f"log_to: {tracker_name} failed to start ({type(err).__name__}: {_first_line(err)}); "
                               "this run goes on without it", style="yellow"), soft_wrap=True)
    return Trackers(opened, console, run_dir)
