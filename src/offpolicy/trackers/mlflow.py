"""MLflow through ``MlflowClient`` (no global active run): a SQLite store ``<run>/mlflow.db`` with the
artifacts in ``<run>/mlartifacts``, unless ``MLFLOW_TRACKING_URI`` is set (``mlflow ui --backend-store-uri
sqlite:///<run>/mlflow.db`` reads it; MLflow 3 refuses its old file store by default). Scalars as
metrics with their step (a character MLflow refuses in a name becomes ``/``: ``metric_name``), the config
as params (flattened) and as ``config.json``, tables as JSON artifacts ``{"columns": [...], "data": [[...]]}``
(``samples/step_NNNNNN.json``, the layout of MLflow's ``log_table``, written by ``log_dict``: ``log_table``
imports pandas, which ``offpolicy[mlflow]`` does not install; every digit kept), plots as artifacts under
``plots/``.

A tracking URI with user information (``http://user:password@host``: MLflow sends it as basic auth) is used as
given, but shown only redacted (``offpolicy.trackers.redact``): trackers.json, the run's last line, and the
"View run" link MLflow prints when the run ends."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from offpolicy.trackers import flatten, redact, redacted_stdout

EXPERIMENT = "offpolicy"
MAX_PARAM = 6000  # MLflow's limit on a param value's length (characters)


class MlflowTracker:
    name = "mlflow"

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
        found = self.client.get_experiment_by_name(experiment)
        # the artifacts beside the store (MLflow's default is ./mlruns in the working directory)
        artifacts = None if os.environ.get("MLFLOW_TRACKING_URI") else (run_dir / "mlartifacts").resolve().as_uri()
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment, artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self.where = {"tracking_uri": redact(uri), "experiment": experiment, "run_id": self.run_id}
        params = [Param(k, str(v)[:MAX_PARAM]) for k, v in flatten(config).items()]
        for start in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_name(key), value, now, step) for key, value in values.items()]
        for start in range(0, len(metrics), 1000):  # log_batch's limit: 1,000 metrics a call
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def log_table(self, key: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.client.log_dict(self.run_id, {"columns": list(columns), "data": [list(row) for row in rows]},
                             f"{key}/step_{step:06d}.json")

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        for path in images.values():
            self.client.log_artifact(self.run_id, str(path), "plots")

    def log_summary(self, values: dict[str, float]) -> None:
        self.log_metrics(0, values)

    def close(self, failed: bool = False) -> None:
        # MLflow prints a "View run" link for a server's run, its host with the URI's user information
        with redacted_stdout():
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def metric_name(key: str) -> str:
    """``key`` as MLflow accepts it: alphanumerics, ``_ - . : /`` and spaces; anything else becomes ``/``
    (diagnose's ``masked_fraction@verl:decoupled_seq_is_rs`` → ``masked_fraction/verl:decoupled_seq_is_rs``).
    Every name ``train`` logs is already valid and kept as it is."""
    return re.sub(r"[^\w\-.: /]", "/", key)


def open(run_dir: Path, name: str, config: dict[str, Any], start_step: int = 0) -> MlflowTracker:  # noqa: A001
    return MlflowTracker(run_dir, name, config)
