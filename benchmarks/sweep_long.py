"""Which correction trains best on short *and* long responses, as staleness grows? (issue #12)

`recommended` was chosen by `mismatch_sweep.py` on digit reversal, whose answers are ~5 tokens.
This sweep adds the `walk` task (answers of 50–150 tokens: products of per-token ratios drift
far from 1, sequence truncation saturates) and runs every correction over staleness × engine
dtype × seeds, in two stages so that 2 CPU cores can afford it:

    stage screen  every method, staleness 4, bf16, seed 0, each task          (which are worth seeds?)
    stage final   the finalists × staleness {0, 2, 4, 8} × {bf16, fp16} × seeds {0, 1, 2}

    python benchmarks/sweep_long.py --stage screen                     # ~1.5 min a run on 2 cores
    python benchmarks/sweep_long.py --stage final --finalists auto:4   # top 4 of the screen + none
    python benchmarks/sweep_long.py --stage final --workers 16         # a many-core machine
    python benchmarks/sweep_long.py --report                           # table + plot from the file

Every finished run is appended to ``--out/results.json`` (rewritten atomically: temp file +
rename), keyed by (stage, task, method, staleness, dtype, seed); a rerun skips the keys already
there, so an interrupted sweep continues where it stopped. ``--workers N`` runs N runs at once,
one process each with one torch thread (hf engine); only the parent writes the results file.

Methods live in ``METHODS`` (name → loss overrides on a PPO ε = 0.2 token-mean base): add an
entry (or call ``register``) to put a new correction into the sweep. Cells report final reward
(mean of the last 25 % of steps), greedy eval accuracy at the end, mismatch statistics of the
*uncorrected* ratio π_old/μ (KL k3, χ² of the sequence, mean |log ρ|, ESS) and the fraction of
tokens the correction masked, as mean ± std over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BASE_LOSS: dict[str, Any] = {"kind": "ppo", "clip_low": 0.2, "clip_high": 0.2, "agg": "token-mean"}


@dataclass(frozen=True)
class Method:
    """A correction under test: ``correction`` (a preset name or a CorrectionConfig dict; None =
    measure only) and loss fields that differ from ``BASE_LOSS``."""

    summary: str
    correction: str | dict | None = None
    loss: dict | None = None
    train: dict | None = None  # TrainConfig fields that differ from TASK_RUNS (minibatches, prox_logp)


# Geo-RS: the geometric mean of ρ is length-normalised, so its band does not need to widen with
# length — but verl's ±0.1 % rejected 53–99 % of the short-task batches (docs/science.md), so ±2 % here.
GEO_BAND = {"low": 0.98, "high": 1.02}
METHODS: dict[str, Method] = {
    "none": Method("PPO against π_old, no correction (ratios measured only)"),
    "token_tis": Method("token TIS, w_t = min(ρ_t, 2)", "verl:decoupled_token_is"),
    "seq_tis": Method("sequence TIS, w = min(Π ρ_t, 2)", "verl:decoupled_seq_is"),
    "seq_mis": Method("Seq-MIS: seq TIS 2 + reject rows with Π ρ ∉ [0.5, 2]", "verl:decoupled_seq_is_rs"),
    "geo_rs": Method("Geo-RS: reject rows with geometric-mean ρ ∉ [0.98, 1.02]",
                     {"anchor": "old", "reject": [{"stat": "ratio", "level": "geometric", **GEO_BAND}]}),
    "veto": Method("any-token veto: reject rows with a token ρ_t < 1e-4",
                   {"anchor": "old", "reject": [{"stat": "ratio", "level": "any_token", "low": 1e-4}]}),
    "seq_tis_veto": Method("seq TIS 2 + any-token veto (`recommended` until this sweep)",
                           {"anchor": "old", "weight": {"level": "sequence", "mode": "truncate", "high": 2.0},
                            "reject": [{"stat": "ratio", "level": "any_token", "low": 1e-4}]}),
    "recommended": Method("the `recommended` preset as it is now", "recommended"),
    "decoupled": Method("AReaL decoupled PPO: ratio to π_prox, behaviour weight ρ_t masked above 5",
                        "areal:token_mask"),
    "bypass": Method("bypass: PPO's ratio is π_θ/μ (two policies)", "verl:bypass_ppo_clip"),
    # bypass's trust region is where reverse loses its last points at staleness 8 (clip fraction 6.7 %):
    # DAPO's clip-higher (ε_high 0.28) and a wider symmetric clip keep more of the stale tokens
    "bypass_clip_higher": Method("bypass with PPO clip [1 − 0.2, 1 + 0.28] (DAPO's clip-higher)",
                                 "verl:bypass_ppo_clip", {"clip_low": 0.2, "clip_high": 0.28}),
    "bypass_0.4": Method("bypass with PPO clip [1 − 0.4, 1 + 0.4]", "verl:bypass_ppo_clip",
                         {"clip_low": 0.4, "clip_high": 0.4}),
    "bypass_0.6": Method("bypass with PPO clip [1 − 0.6, 1 + 0.6]", "verl:bypass_ppo_clip",
                         {"clip_low": 0.6, "clip_high": 0.6}),
    "cispo": Method("CISPO on π_θ/μ: −sg(min(π_θ/μ, 2))·A·log π_θ", {"anchor": "rollout"},
                    {"kind": "cispo", "clip_low": None, "clip_high": 1.0}),
    # bounds chosen from each batch (issue #12 item 2) and AReaL's adaptive mask (issue #14)
    "seq_ess": Method("sequence TIS with the largest cap keeping ESS ≥ 0.9 (data-chosen)",
                      {"anchor": "old", "weight": {"level": "sequence", "mode": "truncate",
                                                   "high": {"rule": "ess", "target": 0.9}}}),
    "token_quantile": Method("token TIS capped at the batch's 99th percentile of ρ_t (data-chosen)",
                             {"anchor": "old", "weight": {"level": "token", "mode": "truncate",
                                                          "high": {"rule": "quantile", "q": 0.99}}}),
    "m2po": Method("M2PO: drop the largest (log ρ)² until their mean is < 0.04", "areal:m2po"),
    # two optimizer steps per batch, so that π_old ≠ π_θ on the second and PPO's clip, CISPO and the
    # proximal policy matter (issue #14: AReaL's log-linear π_prox against the π_old forward)
    "none_mb2": Method("as none, 2 mini-batches per batch", train={"minibatches": 2}),
    "decoupled_mb2": Method("decoupled (areal:token_mask), 2 mini-batches, π_old by a forward pass",
                            "areal:token_mask", train={"minibatches": 2}),
    "loglinear_mb2": Method("decoupled, 2 mini-batches, π_old = AReaL's log-linear π_prox (no forward)",
                            "areal:token_mask", train={"minibatches": 2, "prox_logp": "loglinear"}),
    "bypass_mb2": Method("bypass, 2 mini-batches", "verl:bypass_ppo_clip", train={"minibatches": 2}),
}


def register(name: str, method: Method) -> None:
    """Add a method to the sweep (e.g. the adaptive rules: ``register("adaptive", Method(...))``)."""
    METHODS[name] = method


# per task: what a ≤ 2-minute run on 2 cores affords. walk (measured, staleness 0, bf16): 16 prompts
# × 8 take ~2 s a step; at lr 3e-4 its reward collapsed (0.16 → 0.01 in 3 steps, fp32 engine too),
# at 1e-4 it held level for 40 steps — so on walk the sweep measures what staleness breaks.
TASK_RUNS: dict[str, dict[str, Any]] = {
    "reverse": {"steps": 60},
    "walk": {"steps": 40, "prompts_per_step": 16, "group_size": 8, "lr": 1e-4},
}
STALENESS = (0, 2, 4, 8)
DTYPES = ("bf16", "fp16")
# the no-mismatch reference: an fp32 engine at staleness 0 samples from exactly the trainer's policy
REFERENCE = ("none", 0, "fp32")


@dataclass(frozen=True)
class Job:
    stage: str
    task: str
    method: str
    staleness: int
    dtype: str
    seed: int

    @property
    def key(self) -> str:
        return "|".join(str(v) for v in asdict(self).values())

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.task}-{self.method}-st{self.staleness}-{self.dtype}-s{self.seed}"


# ----------------------------------------------------------------------------- results file

def load_results(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def save_results(path: Path, results: list[dict]) -> None:
    """Write all results at once: a temp file in the same folder, fsync, rename. A crash leaves
    either the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".results-", suffix=".json")
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the results private to this user
    with os.fdopen(fd, "w") as f:
        json.dump(results, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def pending(jobs: Iterable[Job], results: list[dict]) -> list[Job]:
    done = {r["key"] for r in results}
    return [j for j in jobs if j.key not in done]


def run_sweep(jobs: list[Job], runner: Callable[[Job], dict], results_path: Path, workers: int = 1,
              log: Callable[[str], None] = print) -> list[dict]:
    """Run the jobs not yet in ``results_path``; each result is saved as soon as it finishes.

    ``runner(job)`` returns the result dict (the sweep adds ``key`` and the job's fields). With
    ``workers`` > 1 runs go to a process pool (``runner`` must be picklable) and the parent alone
    writes the file, in completion order.
    """
    results = load_results(results_path)
    todo = pending(jobs, results)
    log(f"{len(jobs) - len(todo)} of {len(jobs)} runs already in {results_path}; {len(todo)} to go")

    def record(job: Job, result: dict) -> None:
        results.append({**asdict(job), "key": job.key, **result})
        save_results(results_path, results)
        log(f"[{len(results)}] {job.name}: final reward {result['final_reward']:.3f} accuracy "
            f"{_fmt(result.get('eval_accuracy'))} masked {_fmt(result.get('masked_fraction'))} "
            f"({result.get('seconds', 0):.0f}s)")

    if workers <= 1:
        for job in todo:
            record(job, runner(job))
        return results
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_one_thread) as pool:
        futures = {pool.submit(runner, job): job for job in todo}
        for future in as_completed(futures):
            record(futures[future], future.result())
    return results


def _one_thread() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def _fmt(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


# ----------------------------------------------------------------------------- one training run

def train_config(job: Job, out: Path, steps: int | None = None, overrides: dict | None = None):
    from offpolicy.train.config import TrainConfig

    method = METHODS[job.method]
    if isinstance(method.correction, str):
        from offpolicy.core import presets
        correction = presets.correction(method.correction).model_dump()
    else:
        correction = method.correction or {}  # {} = CorrectionConfig(): measure only
    loss = {**BASE_LOSS, **(method.loss or {}), "correction": correction}
    run = {**TASK_RUNS[job.task], **(method.train or {}), **(overrides or {})}
    if steps is not None:
        run["steps"] = steps
    return TrainConfig(engine={"kind": "hf", "dtype": job.dtype}, task=job.task, max_staleness=job.staleness,
                       seed=job.seed, preset=None, loss=loss, eval_every=run["steps"],
                       checkpoint_every=run["steps"], out_dir=str(out / "runs" / job.name), **run)


def summarize(rows: list[dict]) -> dict:
    """A run's numbers from its metrics.jsonl rows."""
    def mean(key: str, part=slice(None)) -> float:
        values = [r[key] for r in rows[part] if r.get(key) is not None]
        return statistics.fmean(values) if values else math.nan

    tail = slice(-max(1, len(rows) // 4), None)
    return {
        "final_reward": mean("reward", tail), "reward_auc": mean("reward"),
        "eval_accuracy": rows[-1].get("eval/accuracy"), "start_accuracy": rows[0].get("eval/accuracy"),
        "kl_k3": mean("offpolicy/kl_k3"), "chi2_seq": mean("offpolicy/chi2_seq"),
        "abs_logp_diff_mean": mean("offpolicy/abs_logp_diff_mean"), "ess": mean("offpolicy/ess"),
        "masked_fraction": mean("offpolicy/masked_fraction"),
        "fraction_above_high": mean("offpolicy/fraction_above_high"),
        # tokens PPO's clip left without gradient (ratio out of [1-ε, 1+ε] in the direction of A)
        "clip_fraction": mean("offpolicy/clip_fraction"),
        "response_length": mean("response_length"), "step_seconds": mean("step_seconds"),
        "rewards": [r["reward"] for r in rows],
    }


@dataclass(frozen=True)
class TrainRunner:
    """Runs a job with ``offpolicy train`` (hf engine) under ``out``; picklable for the pool."""

    out: str
    steps: int | None = None
    overrides: dict | None = None  # TrainConfig fields for every run (--quick shrinks the runs)

    def __call__(self, job: Job) -> dict:
        from rich.console import Console

        from offpolicy.train.loop import train

        cfg = train_config(job, Path(self.out), self.steps, self.overrides)
        shutil.rmtree(cfg.out_dir, ignore_errors=True)  # a run cut short last time starts over
        start = time.perf_counter()
        result = train(cfg, progress=False, console=Console(quiet=True))
        rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        return {**summarize(rows), "steps": cfg.steps, "seconds": time.perf_counter() - start}


# ----------------------------------------------------------------------------- stages

def screen_jobs(tasks: list[str], methods: list[str], staleness: int = 4, dtype: str = "bf16",
                seed: int = 0) -> list[Job]:
    return [Job("screen", t, m, staleness, dtype, seed) for t in tasks for m in methods]


def finalists(results: list[dict], task: str, spec: str) -> list[str]:
    """``auto:K``: the K best methods of the task's screen by final reward, plus ``none``; or a
    comma-separated list."""
    if not spec.startswith("auto:"):
        return spec.split(",")
    k = int(spec.split(":", 1)[1])
    screened = sorted((r for r in results if r["stage"] == "screen" and r["task"] == task),
                      key=lambda r: -r["final_reward"])
    if not screened:
        raise SystemExit(f"--finalists {spec}: no screen results for task {task!r} yet; run --stage screen first")
    chosen = [r["method"] for r in screened if r["method"] != "none"][:k]
    return ["none", *chosen]


def final_jobs(results: list[dict], tasks: list[str], spec: str, seeds: list[int],
               staleness: Iterable[int] = STALENESS, dtypes: Iterable[str] = DTYPES,
               reference: bool = True) -> list[Job]:
    """The finalists at every level; with ``reference``, first the no-mismatch runs (``REFERENCE``:
    none, staleness 0, fp32 engine) that the goal is measured against."""
    ref = [Job("final", t, *REFERENCE, seed) for t in tasks for seed in seeds] if reference else []
    return ref + [Job("final", t, m, s, d, seed) for t in tasks for m in finalists(results, t, spec)
                  for s in staleness for d in dtypes for seed in seeds]


# ----------------------------------------------------------------------------- quick (CI)

# --quick: every stage of the machinery at a size CI affords (< 3 minutes on 2 cores, warm start
# included): a 10-step warm start, 3 RL steps of 2 prompts × 4, staleness 0 and 2, a greedy eval of 8
# problems at the first and last step (the full runs' 128 were most of the quick sweep's time).
QUICK_METHODS = ("none", "recommended")
QUICK_STALENESS = (0, 2)
QUICK_OVERRIDES: dict[str, Any] = {
    "steps": 3, "prompts_per_step": 2, "group_size": 4, "eval_problems": 8,
    "warm_start": {"max_steps": 10, "eval_every": 5, "eval_problems": 16},
}
QUICK_FINITE = ("final_reward", "reward_auc", "kl_k3", "abs_logp_diff_mean", "ess", "masked_fraction",
                "response_length")


def quick_jobs(tasks: list[str], methods: Iterable[str] = QUICK_METHODS) -> list[Job]:
    return [Job("quick", t, m, s, "bf16", 0) for t in tasks for m in methods for s in QUICK_STALENESS]


def check_quick(jobs: list[Job], results: list[dict]) -> list[str]:
    """What must hold after a quick sweep: every run finished, with finite numbers and a reward
    per step. (Nothing about which correction wins: 3 steps cannot say.)"""
    by_key = {r["key"]: r for r in results}
    problems = []
    for job in jobs:
        r = by_key.get(job.key)
        if r is None:
            problems.append(f"{job.name}: no result")
            continue
        bad = [k for k in QUICK_FINITE if not isinstance(r.get(k), (int, float)) or not math.isfinite(r[k])]
        if bad:
            problems.append(f"{job.name}: non-finite {', '.join(bad)}")
        if len(r.get("rewards", [])) != r.get("steps"):
            problems.append(f"{job.name}: {len(r.get('rewards', []))} rewards for {r.get('steps')} steps")
    return problems


# ----------------------------------------------------------------------------- report

def _mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def groups(results: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in results:
        out.setdefault((r["stage"], r["task"], r["staleness"], r["dtype"], r["method"]), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0] != "screen", *kv[0][1:4],
                                                   list(METHODS).index(kv[0][4]) if kv[0][4] in METHODS else 99)))


def table(results: list[dict]):
    from rich.table import Table

    t = Table(title="long-response sweep: mean ± std over seeds (final reward = last 25 % of steps)")
    for col in ("stage", "task", "stale", "dtype", "method", "n", "final reward", "accuracy", "KL k3",
                "χ² seq", "|log ρ|", "ESS", "masked", "s/run"):
        t.add_column(col, justify="left" if col in ("stage", "task", "dtype", "method") else "right")
    for (stage, task, st, dtype, method), rs in groups(results).items():
        t.add_row(stage, task, str(st), dtype, method, str(len(rs)), _mean_std([r["final_reward"] for r in rs]),
                  _mean_std([r["eval_accuracy"] for r in rs]),
                  f"{statistics.fmean(r['kl_k3'] for r in rs):.2e}", f"{statistics.fmean(r['chi2_seq'] for r in rs):.2e}",
                  f"{statistics.fmean(r['abs_logp_diff_mean'] for r in rs):.1e}",
                  f"{statistics.fmean(r['ess'] for r in rs):.3f}",
                  f"{statistics.fmean(r['masked_fraction'] for r in rs):.3f}",
                  f"{statistics.fmean(r['seconds'] for r in rs):.0f}")
    return t


def markdown(results: list[dict]) -> str:
    """The table as Markdown (for docs/science.md): one row per (stage, task, staleness, dtype, method)."""
    lines = ["| stage | task | staleness | dtype | method | seeds | final reward | accuracy | KL k3 | ESS | masked |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for (stage, task, st, dtype, method), rs in groups(results).items():
        lines.append(f"| {stage} | {task} | {st} | {dtype} | {method} | {len(rs)} | "
                     f"{_mean_std([r['final_reward'] for r in rs])} | {_mean_std([r['eval_accuracy'] for r in rs])} | "
                     f"{statistics.fmean(r['kl_k3'] for r in rs):.2e} | {statistics.fmean(r['ess'] for r in rs):.3f} | "
                     f"{statistics.fmean(r['masked_fraction'] for r in rs):.3f} |")
    return "\n".join(lines)


def _reference_runs(rows: list[dict], task: str) -> list[dict]:
    """The task's no-mismatch runs (``REFERENCE``), one per seed."""
    return [r for r in rows if (r["task"], r["method"], r["staleness"], r["dtype"]) == (task, *REFERENCE)]


def _reference(rows: list[dict], task: str, key: str) -> list[float]:
    """``key`` of the task's no-mismatch runs, one value per seed."""
    return [r[key] for r in _reference_runs(rows, task)]


def kept_share(results: list[dict], stage: str = "final", key: str = "final_reward") -> str:
    """The issue's goal as a Markdown table: per task, engine dtype and staleness, each method's mean
    ``key`` (final reward — of the rollouts, so of μ, up to s versions old — or ``eval_accuracy``,
    greedy, of the trained policy itself) as a share of the no-mismatch reference (``REFERENCE``: none,
    staleness 0, fp32 engine, same seeds); bold where ``none`` lost ≥ 30 % (the goal cells)."""
    rows = [r for r in results if r["stage"] == stage]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    lines = ["| task | dtype | staleness | reference | " + " | ".join(methods) + " |",
             "|---|---|---:|---:|" + "---:|" * len(methods)]
    for task in sorted({r["task"] for r in rows}):
        ref = _reference(rows, task, key)
        if not ref:
            continue
        base = statistics.fmean(ref)
        for dtype in [d for d in DTYPES if any(r["task"] == task and r["dtype"] == d for r in rows)]:
            for st in sorted({r["staleness"] for r in rows if r["task"] == task and r["dtype"] == dtype}):
                cells = []
                for m in methods:
                    vals = [r[key] for r in rows
                            if (r["task"], r["dtype"], r["staleness"], r["method"]) == (task, dtype, st, m)]
                    share = statistics.fmean(vals) / base if vals and base > 0 else math.nan
                    mark = "**" if m == "none" and share <= 0.7 else ""
                    cells.append("" if not vals else f"{mark}{100 * share:.0f} %{mark}")
                lines.append(f"| {task} | {dtype} | {st} | {base:.3f} (n={len(ref)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmean(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over the runs that have it (older results lack newer keys): NaN if none."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    return statistics.fmean(values) if values else math.nan


def mismatch_cell(rows: list[dict]) -> str:
    """The engine/trainer mismatch a cell's runs saw: mean KL k3(μ‖π_θ) / mean normalised ESS."""
    return f"{_fmean(rows, 'kl_k3'):.1e} / {_fmean(rows, 'ess'):.2f}"


def dropped_cell(rows: list[dict]) -> str:
    """Share of tokens without gradient, in %: masked by the correction / clipped by PPO."""
    return f"{100 * _fmean(rows, 'masked_fraction'):.1f} / {100 * _fmean(rows, 'clip_fraction'):.1f}"


def matrix(results: list[dict], stage: str = "final", key: str = "final_reward",
           cell: Callable[[list[dict]], str] | None = None) -> str:
    """``key`` as mean ± std over seeds (or ``cell(runs)``), one row per (task, method), one column
    per (dtype, staleness) — the final stage at a glance (the no-mismatch reference is its own row)."""
    cell = cell or (lambda rs: _mean_std([r[key] for r in rs]))
    rows = [r for r in results if r["stage"] == stage]
    cols = sorted({(r["dtype"], r["staleness"]) for r in rows if r["dtype"] != REFERENCE[2]},
                  key=lambda c: (DTYPES.index(c[0]) if c[0] in DTYPES else 9, c[1]))
    lines = ["| task | method | " + " | ".join(f"{d} s={st}" for d, st in cols) + " |",
             "|---|---|" + "---:|" * len(cols)]
    for task in sorted({r["task"] for r in rows}):
        ref = _reference_runs(rows, task)
        if ref:
            lines.append(f"| {task} | reference (none, {REFERENCE[2]} engine, s=0): {cell(ref)} |"
                         + " |" * len(cols))
        for m in [m for m in METHODS if any(r["task"] == task and r["method"] == m for r in rows)]:
            runs = [[r for r in rows if (r["task"], r["method"], r["dtype"], r["staleness"]) == (task, m, d, st)]
                    for d, st in cols]
            if any(runs):
                lines.append(f"| {task} | {m} | " + " | ".join(cell(rs) if rs else "" for rs in runs) + " |")
    return "\n".join(lines)


def _shares(results: list[dict], stage: str = "final", key: str = "final_reward") -> dict[tuple, dict[str, float]]:
    """(task, dtype, staleness) → method → mean ``key`` / the task's no-mismatch reference."""
    rows = [r for r in results if r["stage"] == stage]
    out: dict[tuple, dict[str, float]] = {}
    for task in sorted({r["task"] for r in rows}):
        ref = _reference(rows, task, key)
        if not ref or statistics.fmean(ref) <= 0:
            continue
        base = statistics.fmean(ref)
        for r in rows:
            if r["task"] != task or (r["method"], r["staleness"], r["dtype"]) == REFERENCE:
                continue
            cell = out.setdefault((task, r["dtype"], r["staleness"]), {})
            cell.setdefault(r["method"], []).append(r[key] / base)
    return {k: {m: statistics.fmean(v) for m, v in cell.items()} for k, cell in out.items()}


def ranking(results: list[dict], stage: str = "final", key: str = "final_reward") -> str:
    """How `recommended` is chosen: over the cells where uncorrected GRPO keeps ≤ 70 % of the
    no-mismatch reward (the issue's goal cells), each method's worst and mean share of that reward,
    and its mean share over every cell; best worst case first (a default must not fail anywhere)."""
    shares = _shares(results, stage, key)
    # goal cells are where none lost ≥ 30 % of its final reward, whichever number is ranked
    by_reward = shares if key == "final_reward" else _shares(results, stage)
    goal = [k for k, cell in by_reward.items() if cell.get("none", math.inf) <= 0.7]
    methods = sorted({m for cell in shares.values() for m in cell if m != "none"})
    scored = []
    for m in methods:
        in_goal = [shares[k][m] for k in goal if m in shares[k]]
        every = [cell[m] for cell in shares.values() if m in cell]
        if in_goal:
            scored.append((min(in_goal), statistics.fmean(in_goal), statistics.fmean(every), len(in_goal), m))
    lines = [f"{key}: goal cells (none ≤ 70 % of the reference's final reward): {len(goal)} of {len(shares)}",
             "| method | worst share in goal cells | mean share in goal cells | mean share, every cell | cells |",
             "|---|---:|---:|---:|---:|"]
    # a method run in only some of the goal cells is ranked after those run in all of them
    for worst, mean_goal, mean_all, n, m in sorted(scored, key=lambda t: (t[3] == len(goal), t[:3]), reverse=True):
        lines.append(f"| {m} | {100 * worst:.0f} % | {100 * mean_goal:.0f} % | {100 * mean_all:.0f} % | "
                     f"{n}{'' if n == len(goal) else f' of {len(goal)}'} |")
    return "\n".join(lines)


def _mean_curve(curves: list[list[float]]) -> list[float]:
    n = min(len(c) for c in curves)
    mean = [statistics.fmean(c[k] for c in curves) for k in range(n)]
    return [statistics.fmean(mean[max(0, k - 4): k + 1]) for k in range(n)]  # 5-step trailing mean


def plot(results: list[dict], path: Path, stages: Iterable[str] = ("screen", "final")) -> None:
    """Reward curves per method (mean over seeds, 5-step mean): one row per (stage, task, dtype),
    one panel per staleness. The no-mismatch reference (``REFERENCE``) is the dashed black curve in
    every panel of its task; methods with their own training settings (``*_mb2``) are left to the
    table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r["stage"] in stages]
    ref_dtype = REFERENCE[2]
    rows = sorted({(r["stage"], r["task"], r["dtype"]) for r in results if r["dtype"] != ref_dtype},
                  key=lambda k: (k[0] != "screen", k[1:]))
    cols = sorted({r["staleness"] for r in results})
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.2 * len(cols), 3.2 * len(rows)), squeeze=False,
                             constrained_layout=True)
    plain = [m for m in METHODS if METHODS[m].train is None and any(r["method"] == m for r in results)]
    palette = plt.cm.tab10 if len(plain) <= 10 else plt.cm.tab20  # distinct colours for the methods shown
    colors = {m: palette(i % palette.N) for i, m in enumerate(plain)}
    for i, (stage, task, dtype) in enumerate(rows):
        reference = _reference([r for r in results if r["stage"] == stage], task, "rewards")
        for j, st in enumerate(cols):
            ax = axes[i][j]
            if reference:
                ax.plot(_mean_curve(reference), "k--", lw=1.2, label="no mismatch (none, fp32, staleness 0)")
            for method in plain:
                curves = [r["rewards"] for r in results if (r["stage"], r["task"], r["dtype"], r["staleness"],
                                                            r["method"]) == (stage, task, dtype, st, method)]
                if curves:
                    ax.plot(_mean_curve(curves), label=method, lw=1.4, color=colors[method])
            ax.set_title(f"{stage} · {task} · {dtype} · staleness {st}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.set_xlabel("step")
        axes[i][0].set_ylabel("reward (5-step mean)")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if len(cols) == 1:  # one panel wide (the screen): the legend beside it, not cut off below it
        fig.legend(handles, labels, fontsize=8, loc="outside right upper")
    else:
        fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=min(len(labels), 5))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=["screen", "final", "all"], default=None,
                        help="all = screen, then final with --finalists, then the report")
    parser.add_argument("--quick", action="store_true",
                        help="CI: none and recommended at staleness 0 and 2, 3 tiny steps each, fresh results in "
                             "--out (default runs/sweep_quick); exits 1 unless every run finished with finite metrics")
    parser.add_argument("--tasks", default="reverse,walk")
    parser.add_argument("--methods", default=",".join(METHODS), help="screen: the methods to screen")
    parser.add_argument("--finalists", default="auto:4", help="final: auto:K (top K of the screen + none) or a list")
    parser.add_argument("--seeds", default="0,1,2", help="final: seeds")
    parser.add_argument("--staleness", default=",".join(map(str, STALENESS)), help="final: staleness levels")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="final: engine dtypes")
    parser.add_argument("--no-reference", action="store_true",
                        help="final: skip the no-mismatch runs (none, staleness 0, fp32 engine)")
    parser.add_argument("--screen-staleness", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="override the per-task steps (TASK_RUNS)")
    parser.add_argument("--workers", type=int, default=1, help="parallel runs, one process and one thread each")
    parser.add_argument("--out", default=None, help="results folder (default runs/sweep_long, --quick: "
                        "runs/sweep_quick)")
    parser.add_argument("--report", action="store_true", help="only print the table and write the plot")
    parser.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped or logged: rich would assume 80 columns and cut the numbers
        console = Console(width=200)
    out = Path(args.out or ("runs/sweep_quick" if args.quick else "runs/sweep_long"))
    path = out / "results.json"
    tasks = args.tasks.split(",")
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if args.workers > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
    if args.quick:
        if path.exists():
            path.unlink()  # a quick run checks this code, not an older run's results
        jobs = quick_jobs(tasks)
        run_sweep(jobs, TrainRunner(str(out), overrides=QUICK_OVERRIDES), path, workers=args.workers,
                  log=console.print)
        results = load_results(path)
        console.print(table(results))
        problems = check_quick(jobs, results)
        if problems:
            console.print("[red]quick sweep failed:[/red]\n  " + "\n  ".join(problems))
            raise SystemExit(1)
        console.print(f"quick sweep: {len(jobs)} runs finished, every metric finite ({path})")
        return
    runner = TrainRunner(str(out), args.steps)
    if args.stage in ("screen", "all"):
        run_sweep(screen_jobs(tasks, args.methods.split(","), staleness=args.screen_staleness), runner, path,
                  workers=args.workers, log=console.print)
    if args.stage in ("final", "all"):
        jobs = final_jobs(load_results(path), tasks, args.finalists, [int(s) for s in args.seeds.split(",")],
                          [int(s) for s in args.staleness.split(",")], args.dtypes.split(","),
                          reference=not args.no_reference)
        run_sweep(jobs, runner, path, workers=args.workers, log=console.print)
    results = load_results(path)
    if not results:
        console.print(f"no results in {path} yet: run --stage screen")
        return
    console.print(table(results))
    if args.markdown:
        print(markdown(results))
        for key in ("final_reward", "eval_accuracy"):
            print(f"\n{key}, mean ± std over seeds\n")
            print(matrix(results, key=key))
            print(f"\n{key}, share of the no-mismatch reference\n")
            print(kept_share(results, key=key))
            print()
            print(ranking(results, key=key))
        print("\nmismatch each cell's runs saw: KL k3(μ‖π_θ) / normalised ESS, mean over seeds and steps\n")
        print(matrix(results, cell=mismatch_cell))
        print("\ntokens without gradient, %: masked by the correction / clipped by PPO, mean over seeds and steps\n")
        print(matrix(results, cell=dropped_cell))
    plots = []
    for stage, name in (("screen", "sweep_long_screen.png"), ("final", "sweep_long.png")):
        if any(r["stage"] == stage for r in results):
            plot(results, out / name, stages=(stage,))
            plots.append(str(out / name))
    console.print(f"results: {path}  plots: {', '.join(plots)}")


if __name__ == "__main__":
    sys.exit(main())
