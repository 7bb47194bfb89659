"""Run logging: one JSON line per step (``metrics.jsonl``), a progress bar, a few sample completions per
step (``samples.jsonl``, with their per-token log-probs for ``offpolicy view``), the trackers of ``log_to``
(TensorBoard by default; W&B, MLflow, Trackio: ``offpolicy.trackers``), and at the end PNG plots and a
summary table."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

PLOTS = [
    ("reward", "reward (mean over samples)", ["reward", "eval/accuracy"]),
    ("mismatch", "mismatch KL k3 (trainer π_old vs engine μ)", ["offpolicy/kl_k3"]),
    ("masked", "masked fraction (rejected tokens)", ["offpolicy/masked_fraction"]),
    ("ess", "ESS of ρ = π_old/μ", ["offpolicy/ess"]),
]


STAGES = ["generate", "wait", "score", "pi_old", "samples", "train", "sync", "log", "eval", "write"]
SUMMARY_WINDOW = 5  # steps averaged at each end of the run summary (fewer for short runs: see summary)


class StageTimer:
    """Seconds per named stage of one step: ``with timer("train"): …``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def sample_records(problems, completions: list[str], rewards, advantages, log_ratio, mask,
                   finished: list[bool], token_texts: list[list[str]] | None = None, trainer=None,
                   rollout=None) -> list[dict[str, Any]]:
    """One JSON-able record per sampled row: its prompt, the completion as the reward read it, the reference
    answer, reward, advantage, length, whether it stopped on its own, and its per-token log ρ = log π_old −
    log μ (``log_ratio``, ``mask`` ``[k, T]``): mean and max |log ρ| over the row's tokens that have a ratio
    (a token outside the trainer's top-k/top-p support has log π = −inf and none: it is counted in
    ``outside_support``, as the loss leaves it out).

    With ``token_texts`` (each row's response tokens as text) and the log-probs ``trainer`` (log π_old) and
    ``rollout`` (log μ), ``[k, T]``, the record also holds them per token (``token_text``, ``log_pi``,
    ``log_mu``; null where not finite): what ``offpolicy view`` colours."""
    out = []
    for i, problem in enumerate(problems):
        valid = mask[i].bool()
        finite = valid & (log_ratio[i].abs() < math.inf)  # excludes ±inf and NaN
        lr = log_ratio[i][finite].abs()
        record = {"prompt": problem.prompt, "completion": completions[i], "answer": problem.answer,
                  "reward": float(rewards[i]), "advantage": float(advantages[i]), "tokens": int(valid.sum()),
                  "outside_support": int((valid & ~finite).sum()),
                  "finished": bool(finished[i]),
                  "abs_log_ratio_mean": float(lr.mean()) if lr.numel() else None,
                  "abs_log_ratio_max": float(lr.max()) if lr.numel() else None}
        if token_texts is not None and trainer is not None and rollout is not None:
            n = int(valid.sum())  # response tokens are left-aligned: the first n columns
            record.update(token_text=list(token_texts[i][:n]), log_pi=_floats(trainer[i, :n]),
                          log_mu=_floats(rollout[i, :n]))
        out.append(record)
    return out


def _floats(values) -> list[float | None]:
    """fp32 values as JSON numbers (float32's shortest repr survives the round trip), null where not finite."""
    return [float(f"{v:.8g}") if math.isfinite(v) else None for v in values.float().tolist()]


def read_jsonl(path: Path, torn: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of a JSON-lines file the run appends to, one ``write`` per line (empty lines skipped).

    A hard stop (SIGKILL, out of memory, a full disk) can leave the last line incomplete: a last line
    that does not parse is left out, and a note naming it is appended to ``torn`` (the step it was
    writing is past the checkpoint, so resuming recomputes it). A line that does not parse anywhere
    else was not torn by a stop: that is an error.

    Raises:
        ValueError: a line before the last is not JSON (file, line number and the fix named).
    """
    if not path.exists():
        return []
    # bytes, split on newlines: a stop can also cut a multi-byte character (samples.jsonl keeps non-ASCII text)
    lines = [(n, line) for n, line in enumerate(path.read_bytes().split(b"\n"), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            records.append(json.loads(line.decode("utf-8")))
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {n} is not JSON ({err}) and is not the last line, so it was not "
                                 "torn by a stop; repair or delete that line to resume") from None
            if torn is not None:
                torn.append(f"{path.name}: left out its incomplete last line {n} ({len(line)} characters), "
                            "written when the run was stopped")
    return records


def encode_row(step: int, values: dict[str, Any]) -> dict[str, Any]:
    """One ``metrics.jsonl`` record: JSON has no NaN or infinity, so a non-finite value is written as ``null`` and
    its reason goes to the row's ``nonfinite`` map (``{key: "nan" | "inf" | "-inf"}``); a ``None`` value is left
    out (absent). So a ``null`` always says why, and NaN, ±inf and "not measured" stay three different things
    (``decode_row`` reads them back)."""
    record: dict[str, Any] = {"step": step}
    reasons: dict[str, str] = {}
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            reasons[key] = "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
            value = None
        record[key] = value
    if reasons:
        record[NONFINITE] = reasons
    return record


NONFINITE = "nonfinite"  # the metrics row's map of the keys written as null, and why
_REASONS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def decode_row(row: dict[str, Any]) -> dict[str, Any]:
    """A ``metrics.jsonl`` record as the trainer logged it: each ``null`` becomes the float it stood for. A row
    with a ``nonfinite`` map (``encode_row``) says which value each null was; a row without one was written before
    that map existed, when the logger wrote ``null`` for NaN and nothing else, so its nulls read as NaN. The
    ``nonfinite`` key itself is dropped."""
    reasons = row.get(NONFINITE) or {}
    out = {}
    for key, value in row.items():
        if key == NONFINITE:
            continue
        if value is None:
            value = _REASONS.get(reasons.get(key, "nan"), math.nan)
        out[key] = value
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run's ``metrics.jsonl`` decoded (``decode_row``), one row per step in step order: a resumed run rewrote
    the steps past its checkpoint (the last row of a step wins), and a torn last line is left out."""
    rows = {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        rows[row["step"]] = decode_row(row)
    return [rows[k] for k in sorted(rows)]


class RunLogger:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, console: Console | None = None,
                 progress: bool = True, log_to: list[str] = ("tensorboard",), config: dict[str, Any] | None = None):
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.console = console or Console()
        # on resume, drop lines past the checkpoint: they are recomputed, identically (a torn last line too)
        torn: list[str] = []
        kept = [r for r in read_jsonl(self.path, torn) if r["step"] < start_step]
        self.samples_path = run_dir / "samples.jsonl"
        kept_samples = [r for r in read_jsonl(self.samples_path, torn) if r["step"] < start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.records = kept
        self.samples_path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept_samples))
        for note in torn:
            self.console.print(f"[yellow]  resume: {note}[/yellow]")
        self.write_seconds: list[float] = []
        from offpolicy.trackers import open_trackers

        # before training: a tracker that is missing or cannot start is one line here, never a crash later
        self.trackers = open_trackers(log_to, run_dir, run_dir.name, config or {}, self.console, start_step)
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=self.console, disable=not progress)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
        self.progress.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        start = time.perf_counter()
        record = encode_row(step, values)
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.trackers.log_metrics(step, values)
        status = f"reward {values.get('reward', math.nan):.3f}  kl {values.get('offpolicy/kl_k3', math.nan):.2e}"
        if "eval/accuracy" in values:
            status += f"  acc {values['eval/accuracy']:.2f}"
        if values.get("truncated_share"):  # responses cut by max_new_tokens: a limit set too low, or rambling
            status += f"  truncated {values['truncated_share']:.0%}"
        self.progress.update(self.task, completed=step + 1, status=status)
        self.write_seconds.append(time.perf_counter() - start)  # this call's own cost: the "write" stage

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append ``samples`` (``sample_records``) to ``samples.jsonl`` and to TensorBoard as text."""
        if not samples:
            return
        start = time.perf_counter()
        with self.samples_path.open("a") as f:
            for record in samples:
                f.write(json.dumps({"step": step, **record}, ensure_ascii=False) + "\n")
        self.trackers.log_samples(step, samples)
        if self.write_seconds:  # this step's logger cost (log, then log_samples)
            self.write_seconds[-1] += time.perf_counter() - start

    def close(self) -> None:
        """Stop the progress bar; the trackers stay open for the plots (``finish``)."""
        self.progress.stop()

    def finish(self, plot: Path | None = None, failed: bool = False) -> None:
        """Send the run's plot to the trackers, then close them (``failed``: the run raised)."""
        if plot is not None:
            self.trackers.log_images(max((r["step"] for r in self.records), default=0), {"training": plot})
        self.trackers.close(failed=failed)

    def plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
        for ax, (_, title, keys) in zip(axes.flat, PLOTS):
            for key in keys:
                points = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, ms=3, label=key)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if len(keys) > 1:
                ax.legend(fontsize=8)
        path = self.run_dir / "training.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def summary(self) -> dict[str, float]:
        """First and last values of the headline metrics: means over the first and last w of the n steps
        that have the metric, w = min(5, n // 2) (at least 1) — the two windows never overlap, so a run
        of ≤ 5 steps does not show the same mean twice (one step: both columns are that step)."""
        def window(key: str, last: bool) -> float:
            values = [r[key] for r in self.records if r.get(key) is not None]
            if not values:
                return math.nan
            w = max(1, min(SUMMARY_WINDOW, len(values) // 2))
            part = values[-w:] if last else values[:w]
            return sum(part) / len(part)

        keys = ["reward", "eval/accuracy", "offpolicy/kl_k3", "offpolicy/masked_fraction", "offpolicy/ess",
                "staleness", "generate/tokens_per_s", "truncated_share", "skipped_update",
                # issue #21: throughput, where the step goes; memory: host everywhere, GPU (CUDA runs only)
                "time/tokens_per_s", "time/generate_share", "time/train_share", "memory/peak_rss_gib",
                "memory/peak_gib", "memory/engine_gib"]
        keys = [k for k in keys if not k.startswith("memory/") or any(r.get(k) is not None for r in self.records)]
        table = Table(title=f"run summary — {self.run_dir}")
        table.add_column("metric")
        table.add_column("start", justify="right")
        table.add_column("end", justify="right")
        out = {}
        for key in keys:
            start, end = window(key, last=False), window(key, last=True)
            out[f"{key}/start"], out[f"{key}/end"] = start, end
            table.add_row(key, f"{start:.4g}", f"{end:.4g}")
        self.console.print(table)
        out.update(self.stage_table())
        return out

    def stage_table(self) -> dict[str, float]:
        """Mean seconds per step of each stage over this session's steps (``time/<stage>``), printed
        as a table: where the time goes. ``generate`` is engine time; with overlap it runs in the
        engine's thread and only ``wait`` holds the trainer up."""
        means = {}
        for stage in STAGES:
            values = self.write_seconds if stage == "write" else \
                [r[f"time/{stage}"] for r in self.records if r.get(f"time/{stage}") is not None]
            if values:
                means[f"time/{stage}"] = sum(values) / len(values)
        steps = [r["step_seconds"] for r in self.records if r.get("step_seconds") is not None]
        if not means or not steps:
            return means
        per_step = sum(steps) / len(steps)
        means["time/step"] = per_step
        table = Table(title="time per stage (mean per step)")
        table.add_column("stage")
        table.add_column("ms", justify="right")
        table.add_column("% of step", justify="right")
        for key, value in means.items():
            if key != "time/step":
                table.add_row(key.removeprefix("time/"), f"{1e3 * value:.1f}", f"{100 * value / per_step:.0f}%")
        table.add_row("step", f"{1e3 * per_step:.1f}", f"{1 / per_step:.2f} steps/s")
        self.console.print(table)
        return means
