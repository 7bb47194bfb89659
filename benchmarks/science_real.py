"""Which correction, shown on a real model: the pre-registered long-answer experiment (issue #54).

GRPO on SmolLM2-135M-Instruct with ``task=count`` ("count from 1 to n", answers of 16–110 tokens,
partial credit; src/offpolicy/tasks/count.py), 4 mini-batches a batch (so π_old ≠ π_θ and PPO's clip
binds), ``max_staleness`` 4 and 40 steps. The cells and the rule are registered in docs/science.md
("The long-answer experiment"); this script runs them and applies the rule.

    Tier 1   R         fp32 engine, synchronous, preset none (the no-mismatch reference)
             N         bf16 engine, staleness 4, preset none (what a framework without the fix does)
             C         bf16 engine, staleness 4, recommended
    Tier 2   token_is  bf16, staleness 4, verl:decoupled_token_is       } each against N,
             icepop    bf16, staleness 4, verl:decoupled_token_icepop   } Holm-corrected with
             none_1mb  bf16, staleness 4, preset none, one mini-batch   } C − token_is
    Exploratory (outside the rule): centered — N with loss.score_centering=head (issue #56), where the
             installed offpolicy has that option.

``preset none`` runs with ``loss.correction={}``: the mismatch is measured (``offpolicy/kl_k3`` …) and no
weight changes. Every run is ``python -m offpolicy train`` in its own process and directory
``OUT/CELL/seedN`` (log beside it), ``--jobs`` at once: tier 1 first, each tier seed-major (all its cells
at seed 0, then seed 1 …, so a grid cut short stays balanced). A finished run is skipped, a cut one resumed
from its checkpoint (``checkpoint_every`` 10), one without a checkpoint started again; a finished run's checkpoints are
deleted unless ``--keep-checkpoints`` (the last grid's final checkpoints filled a 64 GB disk).

    python benchmarks/science_real.py --untrained 24 --engine vllm   # the task's probe on the untrained model
    python benchmarks/science_real.py --tier 1 --seeds 0 --jobs 2     # the pilot: R, N, C at one seed
    python benchmarks/science_real.py --tier all --seeds 0,1,2,3,4 --jobs 8 --device cuda
    python benchmarks/science_real.py --tier all --report --json runs/science_long/report.json
    python benchmarks/science_real.py --from-json runs/science_long/report.json   # the table and tests again, no runs

Per run: the primary metric (the mean greedy held-out reward of the last two evals,
``offpolicy.train.evaluate.primary_metric``) and the collapse rule (``evaluate.collapsed``; a run that did
not finish or logged a non-finite metric counts as collapsed). Per contrast: the difference of the cells'
mean primary metric, its percentile-bootstrap 90 % CI (seeds resampled within each cell), the exact
permutation p (every split of the seeds), Holm's adjustment within tier 2, and the smallest effect the
seeds could detect (one-sided α 0.05, power 0.8, the two cells' pooled SD).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offpolicy.train.evaluate import COLLAPSE_RULE, EVAL_KEYS, collapsed, eval_points, primary_metric

# the registered settings (docs/science.md, "The long-answer experiment"); lr: the pilot's choice
RUN = {"task": "count", "prompts_per_step": 4, "group_size": 8, "minibatches": 4, "lr": 3e-5, "steps": 40,
       "temperature": 0.7, "eval_every": 10, "eval_problems": 128, "micro_batch_tokens": 4096, "policy_kl_rows": 8,
       "checkpoint_every": 10, "samples_per_step": 0}
STALENESS = 4
ALPHA, POWER, LEVEL = 0.05, 0.8, 0.90  # one-sided test level, power for the detectable effect, CI level
GATE, RESCUE, EQUIVALENCE = 0.10, 0.05, 0.05  # R − N ≥ GATE; C − N ≥ RESCUE; C − N's CI inside ±EQUIVALENCE
PRIOR_SD = 0.204  # the last grid's pooled SD of the final held-out reward (docs/science_real_gpu.json)


@dataclass(frozen=True)
class Cell:
    name: str
    engine_dtype: str
    staleness: int
    preset: str
    minibatches: int = RUN["minibatches"]
    extra: tuple[str, ...] = field(default=())  # more train overrides (the exploratory cell's option)


CELLS = {c.name: c for c in (
    Cell("R", "fp32", 0, "none"),
    Cell("N", "bf16", STALENESS, "none"),
    Cell("C", "bf16", STALENESS, "recommended"),
    Cell("token_is", "bf16", STALENESS, "verl:decoupled_token_is"),
    Cell("icepop", "bf16", STALENESS, "verl:decoupled_token_icepop"),
    Cell("none_1mb", "bf16", STALENESS, "none", minibatches=1),
    Cell("centered", "bf16", STALENESS, "none", extra=("loss.score_centering=head",)),
)}
TIERS = {"1": ("R", "N", "C"), "2": ("token_is", "icepop", "none_1mb"), "x": ("centered",)}
TIERS["all"] = TIERS["1"] + TIERS["2"]
# (name, a, b, alternative): a − b; tier 2's four are one Holm family
GATE_CONTRAST = ("R − N", "R", "N", "greater")
RESCUE_CONTRAST = ("C − N", "C", "N", "greater")
TIER2_CONTRASTS = (("token_is − N", "token_is", "N", "greater"), ("icepop − N", "icepop", "N", "greater"),
                   ("none_1mb − N", "none_1mb", "N", "greater"), ("C − token_is", "C", "token_is", "two-sided"))


def centering_available() -> bool:
    """Whether the installed offpolicy trains with score centering (issue #56: ``loss.score_centering``): the
    option exists in the library, and ``offpolicy train`` accepts it (it refuses it while its head does not
    compute the support the term reads)."""
    from offpolicy.config import ConfigError, LossConfig
    from offpolicy.train.config import load_train_config

    if "score_centering" not in LossConfig.model_fields:
        return False
    try:
        load_train_config(None, ["loss.score_centering=head"])
    except ConfigError:
        return False
    return True


# ---------------------------------------------------------------- statistics (golden-tested by hand)

def permutation_p(a: list[float], b: list[float], alternative: str = "greater") -> float:
    """The exact permutation p of mean(a) − mean(b): over every way to split the pooled values into groups
    of len(a) and len(b), the share whose difference is at least the observed one (``greater``), or at
    least as far from 0 (``two-sided``). A 1e-9 slack counts ties made unequal by rounding as ties."""
    if not a or not b:
        raise ValueError("permutation_p needs values in both groups")
    pooled, n, total = [*a, *b], len(a), sum(a) + sum(b)

    def diff(sum_a: float) -> float:
        return sum_a / n - (total - sum_a) / len(b)

    observed = diff(sum(a))
    hits = count = 0
    for chosen in itertools.combinations(range(len(pooled)), n):
        d = diff(sum(pooled[i] for i in chosen))
        count += 1
        if alternative == "greater":
            hits += d >= observed - 1e-9
        elif alternative == "two-sided":
            hits += abs(d) >= abs(observed) - 1e-9
        else:
            raise ValueError(f"alternative: greater or two-sided, not {alternative!r}")
    return hits / count


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment: sorted p_(1) ≤ … ≤ p_(m), adjusted p_(i) = max over j ≤ i of
    min(1, (m − j + 1)·p_(j)). A test is rejected at family-wise α when its adjusted p < α."""
    order = sorted(pvalues, key=pvalues.get)
    m, running, out = len(order), 0.0, {}
    for j, name in enumerate(order):
        running = max(running, min(1.0, (m - j) * pvalues[name]))
        out[name] = running
    return out


def bootstrap_ci(stat, groups: list[list[float]], level: float = LEVEL, resamples: int = 10_000, seed: int = 0
                 ) -> tuple[float, float] | None:
    """The percentile bootstrap CI at ``level`` of ``stat(*groups)``: each group resampled with replacement
    (its own size), ``resamples`` times, seeded; resamples where ``stat`` is undefined (None) are left out."""
    if any(len(g) < 2 for g in groups):
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        value = stat(*[[rng.choice(g) for _ in g] for g in groups])
        if value is not None and math.isfinite(value):
            values.append(value)
    if not values:
        return None
    values.sort()
    lo = values[int(math.floor((1 - level) / 2 * (len(values) - 1)))]
    hi = values[int(math.ceil((1 + level) / 2 * (len(values) - 1)))]
    return lo, hi


def mean_diff(a: list[float], b: list[float]) -> float:
    return statistics.fmean(a) - statistics.fmean(b)


def recovered_share(c: list[float], n: list[float], r: list[float]) -> float | None:
    """(C − N) / (R − N) of the means; None where R − N is 0."""
    gap = statistics.fmean(r) - statistics.fmean(n)
    return None if gap == 0 else (statistics.fmean(c) - statistics.fmean(n)) / gap


def pooled_sd(a: list[float], b: list[float]) -> float | None:
    """√(((n_a − 1)s_a² + (n_b − 1)s_b²) / (n_a + n_b − 2)); None with fewer than 3 values in all."""
    if len(a) + len(b) < 3:
        return None
    ss = sum((x - statistics.fmean(a)) ** 2 for x in a) + sum((x - statistics.fmean(b)) ** 2 for x in b)
    return math.sqrt(ss / (len(a) + len(b) - 2))


def detectable(sd: float, n_a: int, n_b: int, alpha: float = ALPHA, power: float = POWER,
               one_sided: bool = True) -> float:
    """The smallest difference of means a test at ``alpha`` detects with ``power``, by the normal
    approximation: (z_{1−α} + z_power)·sd·√(1/n_a + 1/n_b) (two-sided: z_{1−α/2})."""
    z = statistics.NormalDist().inv_cdf
    return (z(1 - (alpha if one_sided else alpha / 2)) + z(power)) * sd * math.sqrt(1 / n_a + 1 / n_b)


def seeds_needed(effect: float, sd: float, alpha: float = ALPHA, power: float = POWER) -> int:
    """Seeds per cell for ``detectable(sd, n, n) ≤ effect`` (one-sided)."""
    z = statistics.NormalDist().inv_cdf
    return math.ceil(2 * ((z(1 - alpha) + z(power)) * sd / effect) ** 2)


def contrast(name: str, a: list[float], b: list[float], alternative: str, seed: int = 0) -> dict[str, Any]:
    """One contrast's numbers: a − b of the means, its bootstrap CI (``LEVEL``), the exact permutation p,
    the pooled SD and the smallest effect these seeds could detect with it."""
    out: dict[str, Any] = {"contrast": name, "alternative": alternative, "n": [len(a), len(b)], "diff": None,
                           "ci": None, "p": None, "sd": None, "detectable": None}
    if not a or not b:
        return out
    sd = pooled_sd(a, b)
    out.update(diff=mean_diff(a, b), ci=bootstrap_ci(mean_diff, [a, b], seed=seed), p=permutation_p(a, b, alternative),
               sd=sd, detectable=None if sd is None else detectable(sd, len(a), len(b),
                                                                   one_sided=alternative == "greater"))
    return out


def analyse(primary: dict[str, list[float]]) -> dict[str, Any]:
    """The registered analysis of the cells' primary metrics (one value per finished seed; a collapsed run
    keeps its value): the gate, the rescue test and its recovered share, tier 2 with Holm, the verdicts."""
    get = lambda cell: primary.get(cell, [])  # noqa: E731
    gate = contrast(*GATE_CONTRAST[:1], get("R"), get("N"), "greater")
    rescue = contrast(*RESCUE_CONTRAST[:1], get("C"), get("N"), "greater")
    rescue["recovered_share"] = (recovered_share(get("C"), get("N"), get("R"))
                                 if get("C") and get("N") and get("R") else None)
    rescue["recovered_ci"] = (bootstrap_ci(recovered_share, [get("C"), get("N"), get("R")])
                              if get("C") and get("N") and get("R") else None)
    tier2 = [contrast(name, get(a), get(b), alt) for name, a, b, alt in TIER2_CONTRASTS]
    adjusted = holm({t["contrast"]: t["p"] for t in tier2 if t["p"] is not None})
    for t in tier2:
        t["p_holm"] = adjusted.get(t["contrast"])
    return {"gate": gate, "rescue": rescue, "tier2": tier2, "verdict": verdict(gate, rescue, tier2)}


def verdict(gate: dict[str, Any], rescue: dict[str, Any], tier2: list[dict[str, Any]]) -> list[str]:
    """The registered decision rule, in words (docs/science.md)."""
    if gate["diff"] is None:
        return ["gate: not computable (R or N has no finished run)"]
    lines = []
    if gate["detectable"] is not None and gate["detectable"] > GATE:
        lines.append(f"underpowered: at these seeds the gate detects {gate['detectable']:.3f} > {GATE} "
                     "(registered as underpowered)")
    ci = _ci(gate["ci"])
    if gate["diff"] >= GATE and gate["p"] < ALPHA:
        lines.append(f"gate PASSES: R − N = {gate['diff']:.3f} ≥ {GATE}, p = {gate['p']:.4f} < {ALPHA}")
        if rescue["diff"] is not None:
            if rescue["diff"] >= RESCUE and rescue["p"] < ALPHA:
                share = rescue["recovered_share"]
                lines.append(f"the correction MATTERS: C − N = {rescue['diff']:.3f} ≥ {RESCUE}, p = {rescue['p']:.4f}; "
                             f"recovered share {_fmt(share, '.2f')} (90 % CI {_ci(rescue['recovered_ci'])})")
            elif rescue["ci"] is not None and -EQUIVALENCE < rescue["ci"][0] and rescue["ci"][1] < EQUIVALENCE:
                lines.append(f"the correction does NOT rescue: C − N's 90 % CI {_ci(rescue['ci'])} inside "
                             f"±{EQUIVALENCE}")
            else:
                lines.append(f"C − N inconclusive: {rescue['diff']:.3f}, p = {rescue['p']:.4f}, "
                             f"90 % CI {_ci(rescue['ci'])}")
    else:
        lines.append(f"gate FAILS (R − N = {gate['diff']:.3f}, p = {gate['p']:.4f}): the bound on the harm is "
                     f"R − N's 90 % CI {ci}")
    for t in tier2:
        if t["p_holm"] is not None:
            lines.append(f"tier 2 {t['contrast']}: {t['diff']:+.3f}, Holm p = {t['p_holm']:.4f}"
                         f"{' (significant)' if t['p_holm'] < ALPHA else ''}")
    return lines


# ---------------------------------------------------------------- runs

def run_overrides(cell: Cell, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The ``key=value`` overrides of one run: ``RUN`` with the command line's values, the cell, the seed."""
    settings = {**RUN, "steps": args.steps, "lr": args.lr, "prompts_per_step": args.prompts_per_step,
                "group_size": args.group_size, "eval_problems": args.eval_problems, "eval_every": args.eval_every,
                "max_new_tokens": args.max_new_tokens, "model": args.model, "engine": args.engine,
                "engine_dtype": cell.engine_dtype, "max_staleness": cell.staleness, "preset": cell.preset,
                "minibatches": cell.minibatches, "seed": seed, "out_dir": str(run_dir), "device": args.device,
                "trainer_dtype": "fp32"}  # the trainer in fp32 everywhere: the mismatch is the engine's alone
    extra = [*cell.extra, *args.set]
    if cell.preset == "none":  # an empty correction measures the mismatch (offpolicy/kl_k3 …) and changes no weight
        extra.insert(0, "loss.correction={}")
    return [f"{k}={v}" for k, v in settings.items() if v is not None] + extra


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    from offpolicy.train.logger import read_jsonl

    rows = {}
    path = run_dir / "metrics.jsonl"
    for row in (read_jsonl(path) if path.is_file() else []):  # a run cut mid-write leaves a torn last line
        rows[row["step"]] = row  # a resumed run rewrites the steps past its checkpoint: the last wins
    return [rows[k] for k in sorted(rows)]


def finished(run_dir: Path, steps: int) -> bool:
    rows = read_metrics(run_dir)
    return bool(rows) and rows[-1]["step"] >= steps - 1 and "eval/accuracy" in rows[-1]


def command(cell: Cell, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """Resume a cut run (it has a checkpoint), else start it afresh (a directory without one is removed)."""
    base = [sys.executable, "-m", "offpolicy", "train", "--no-progress"]
    if (run_dir / "checkpoints" / "latest").exists():
        return [*base, "--resume", str(run_dir), f"steps={args.steps}"]  # --steps may have grown since
    shutil.rmtree(run_dir, ignore_errors=True)
    return [*base, *run_overrides(cell, seed, args, run_dir)]


def run_env() -> dict[str, str]:
    """One torch/OpenMP thread per run (``--jobs`` of them share the cores); vLLM's CPU backend must not
    pin its threads to cores another run uses; workers sleep instead of spinning (docs/gpu-and-real-data.md)."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
                "MALLOC_ARENA_MAX": "2"})  # fewer malloc arenas: less resident memory per run
    return env


def schedule(cells: list[Cell], seeds: list[int]) -> list[tuple[Cell, int]]:
    """Tier 1 first, then the others; within each, seed-major: every cell at the first seed, then the next
    seed, … (a grid cut short has tier 1 at the most seeds, and every cell of a tier at the same count)."""
    first = [c for c in cells if c.name in TIERS["1"]]
    rest = [c for c in cells if c.name not in TIERS["1"]]
    return [(c, s) for group in (first, rest) for s in seeds for c in group]


def run_grid(cells: list[Cell], seeds: list[int], args: argparse.Namespace) -> list[str]:
    """Run every (cell, seed) not yet finished, ``args.jobs`` at a time; returns the runs that failed."""
    todo = [(c, s) for c, s in schedule(cells, seeds) if not finished(args.out / c.name / f"seed{s}", args.steps)]
    print(f"{len(cells) * len(seeds) - len(todo)} runs finished already, {len(todo)} to run, {args.jobs} at once",
          flush=True)
    running: list[tuple[subprocess.Popen, str, float, Any, Path]] = []
    failed = []
    while todo or running:
        while todo and len(running) < args.jobs:
            cell, seed = todo.pop(0)
            run_dir = args.out / cell.name / f"seed{seed}"
            cmd = command(cell, seed, args, run_dir)
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            log = open(args.out / cell.name / f"seed{seed}.log", "a")
            print(f"start {cell.name} seed {seed}{' (resume)' if '--resume' in cmd else ''}", flush=True)
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env()),
                            f"{cell.name}/seed{seed}", time.time(), log, run_dir))
        time.sleep(1.0)
        for item in list(running):
            proc, name, start, log, run_dir = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            ok = proc.returncode == 0 and finished(run_dir, args.steps)
            rows = read_metrics(run_dir)
            seconds = [r["step_seconds"] for r in rows if "step_seconds" in r]
            timing = f", steps {', '.join(f'{s:.1f}' for s in seconds[:3])} s" if seconds else ""
            print(f"{'done' if ok else 'FAILED'} {name} in {time.time() - start:.0f} s (exit {proc.returncode}"
                  f"{timing})", flush=True)
            if ok and not args.keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # finished: nothing to resume
            if not ok:
                failed.append(name)
    return failed


# ---------------------------------------------------------------- the report

def run_stats(rows: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """One run's numbers from its metrics rows: its evals, the primary metric, whether it finished and
    whether it collapsed (``evaluate.collapsed``, or not finished, or a non-finite training metric), and
    the curves the plots draw."""
    evals = eval_points(rows)
    done = bool(rows) and rows[-1]["step"] >= steps - 1 and bool(evals) and evals[-1]["step"] == rows[-1]["step"]
    finite = all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, (int, float)))

    def curve(key: str) -> list[float | None]:
        return [r.get(key) for r in rows]

    seconds = [r["step_seconds"] for r in rows if "step_seconds" in r]
    kl = [r["offpolicy/kl_k3"] for r in rows if "offpolicy/kl_k3" in r and math.isfinite(r["offpolicy/kl_k3"])]
    return {"done": done, "steps": len(rows), "primary": primary_metric(evals) if done else None,
            "collapsed": not done or not finite or collapsed(evals), "evals": evals,
            "mismatch_k3": statistics.fmean(kl) if kl else None,
            "step_seconds_first": seconds[0] if seconds else None,
            "step_seconds_median": statistics.median(seconds) if seconds else None,
            "reward_curve": curve("reward"), "length_curve": curve("response_length"),
            "truncated_curve": curve("truncated_share"), "mismatch_curve": curve("offpolicy/kl_k3")}


def summarize(runs: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per cell: finished seeds, the primary metric's mean and SD over them, collapses, the last eval's
    truncated share and length, the mean mismatch k3, the median step time."""
    table = []
    for cell, seeds in runs.items():
        done = [r for r in seeds.values() if r["done"]]
        primary = [r["primary"] for r in done]
        last = [r["evals"][-1] for r in done]

        def mean(values):
            values = [v for v in values if v is not None]
            return statistics.fmean(values) if values else None

        table.append({"cell": cell, "runs": len(seeds), "finished": len(done),
                      "primary": mean(primary), "primary_sd": statistics.stdev(primary) if len(primary) > 1 else None,
                      "collapsed": sum(r["collapsed"] for r in seeds.values()),
                      "truncated": mean([e.get("eval/truncated_share") for e in last]),
                      "length": mean([e.get("eval/response_length") for e in last]),
                      "answer_logprob": mean([e.get("eval/answer_logprob") for e in last]),
                      "mismatch_k3": mean([r["mismatch_k3"] for r in done]),
                      "step_seconds": mean([r["step_seconds_median"] for r in seeds.values()])})
    return table


def primaries(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, list[float]]:
    """Each cell's primary metric over its finished seeds, in seed order."""
    return {cell: [seeds[s]["primary"] for s in sorted(seeds, key=int) if seeds[s]["done"]]
            for cell, seeds in runs.items()}


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ci(ci) -> str:
    return "–" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def markdown(table: list[dict[str, Any]], analysis: dict[str, Any]) -> str:
    lines = ["| cell | seeds done | primary (mean ± SD) | collapsed | last eval: truncated | length | answer log-prob "
             "| mismatch k3 | s/step |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in table:
        lines.append(f"| {row['cell']} | {row['finished']}/{row['runs']} | {_fmt(row['primary'], '.3f')} ± "
                     f"{_fmt(row['primary_sd'], '.3f')} | {row['collapsed']}/{row['runs']} | "
                     f"{_fmt(row['truncated'], '.2f')} | {_fmt(row['length'], '.1f')} | "
                     f"{_fmt(row['answer_logprob'], '.1f')} | {_fmt(row['mismatch_k3'], '.1e')} | "
                     f"{_fmt(row['step_seconds'], '.1f')} |")
    lines += ["", "| contrast | seeds | difference | 90 % bootstrap CI | exact p | Holm p | SD | detectable |",
              "|---|---|---:|---|---:|---:|---:|---:|"]
    for c in [analysis["gate"], analysis["rescue"], *analysis["tier2"]]:
        side = "≥" if c["alternative"] == "greater" else "two-sided"
        lines.append(f"| {c['contrast']} ({side}) | {c['n'][0]} v {c['n'][1]} | {_fmt(c['diff'], '+.3f')} | "
                     f"{_ci(c['ci'])} | {_fmt(c['p'], '.4f')} | {_fmt(c.get('p_holm'), '.4f')} | "
                     f"{_fmt(c['sd'], '.3f')} | {_fmt(c['detectable'], '.3f')} |")
    share = analysis["rescue"].get("recovered_share")
    lines += ["", f"recovered share (C − N)/(R − N): {_fmt(share, '.2f')} (90 % CI "
                  f"{_ci(analysis['rescue'].get('recovered_ci'))})", *analysis["verdict"]]
    return "\n".join(lines)


def collect(out: Path, cells: list[str], seeds: list[int] | None, steps: int) -> dict[str, dict[str, dict[str, Any]]]:
    """Every run directory under ``out`` of the named cells (and seeds, when given), seeds as strings (JSON's keys)."""
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for cell in cells:
        for run_dir in sorted((out / cell).glob("seed*")):
            if not run_dir.is_dir():
                continue
            seed = int(run_dir.name[4:])
            if seeds is None or seed in seeds:
                runs.setdefault(cell, {})[str(seed)] = run_stats(read_metrics(run_dir), steps)
    return runs


def plot(runs: dict[str, dict[str, dict[str, Any]]], path: Path, start: dict[str, float] | None = None) -> None:
    """Five panels against the step, one line per cell (mean over its seeds): training reward, held-out
    reward (greedy; the untrained model's dotted), response length, truncated share, mismatch k3 (log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(24, 4.2))
    names = list(CELLS)
    for cell, seeds in runs.items():
        color = f"C{names.index(cell)}" if cell in names else "grey"
        style = {"color": "black" if cell == "R" else color, "label": cell}
        for ax, key, log in ((axes[0], "reward_curve", False), (axes[2], "length_curve", False),
                             (axes[3], "truncated_curve", False), (axes[4], "mismatch_curve", True)):
            curves = [r[key] for r in seeds.values() if r[key]]
            if not curves:
                continue
            n = max(map(len, curves))
            at = [[c[t] for c in curves if len(c) > t and c[t] is not None and (not log or c[t] > 0)] for t in range(n)]
            ys = [statistics.fmean(v) if v else float("nan") for v in at]
            (ax.semilogy if log else ax.plot)(range(n), ys, **style)
        evals: dict[int, list[float]] = {}
        for r in seeds.values():
            for e in r["evals"]:
                evals.setdefault(e["step"], []).append(e["eval/accuracy"])
        steps = sorted(evals)
        axes[1].plot(steps, [statistics.fmean(evals[s]) for s in steps], "o-", **style)
    if start and start.get("eval/accuracy") is not None:
        axes[1].axhline(start["eval/accuracy"], color="grey", linestyle=":", label="untrained")
    for ax, title in zip(axes, ("training reward", "held-out reward (greedy)", "response length (tokens)",
                                "truncated share", "mismatch KL k3 (π vs μ)")):
        ax.set(title=f"{title}, mean over seeds", xlabel="step")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(runs: dict[str, dict[str, dict[str, Any]]]) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """The table, the registered analysis and their markdown, from per-run stats (run directories or a JSON)."""
    table = summarize(runs)
    analysis = analyse(primaries(runs))
    return table, analysis, markdown(table, analysis)


# ---------------------------------------------------------------- the untrained model

def untrained_held_out(args: argparse.Namespace) -> dict[str, float]:
    """The untrained model's eval (``evaluate.evaluate`` on the first ``--eval-problems`` held-out prompts, the
    fp32 trainer's weights): where every run starts. Cached in ``OUT/untrained.json``."""
    cache = args.out / "untrained.json"
    key = f"{Path(args.model).resolve()}|{args.task}|{args.eval_problems}|{args.max_new_tokens}|{args.task_params}"
    if cache.is_file() and json.loads(cache.read_text()).get("key") == key:
        return json.loads(cache.read_text())["eval"]
    import torch

    from offpolicy.policy.score import load_policy
    from offpolicy.tasks import ChatRendered, make_task
    from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer
    from offpolicy.train.evaluate import evaluate

    tokenizer = load_tokenizer(args.model)
    ensure_pad_token(tokenizer)
    task = ChatRendered.of(make_task(args.task, **json.loads(args.task_params)), tokenizer)
    policy = load_policy(args.model, torch.device(args.device))
    value = evaluate(policy, tokenizer, task, list(task.held_out[: args.eval_problems]),
                     args.max_new_tokens or task.max_new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "eval": value}))
    return value


def untrained(args: argparse.Namespace, prompts: int) -> dict[str, float]:
    """The task's probe: ``prompts`` training prompts × ``--group-size`` samples from the engine in fp32 at the
    run's temperature; mean reward, exact share, groups whose rewards differ, length, truncated share."""
    import torch

    from offpolicy.engines import SamplingConfig, make_engine
    from offpolicy.tasks import ChatRendered, make_task, problems
    from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer
    from offpolicy.train.loop import groups_with_spread

    tokenizer = load_tokenizer(args.model)
    ensure_pad_token(tokenizer)
    task = ChatRendered.of(make_task(args.task, **json.loads(args.task_params)), tokenizer)
    rows = [p for p in problems(task, prompts, seed=12_345) for _ in range(args.group_size)]
    args.out.mkdir(parents=True, exist_ok=True)
    engine = make_engine(args.engine, args.model, tokenizer, "fp32", seed=0, max_model_len=1024,
                         log_path=args.out / "untrained-engine.log")
    try:
        sampling = SamplingConfig(max_tokens=args.max_new_tokens or task.max_new_tokens, temperature=RUN["temperature"])
        out = engine.generate([list(p.prompt_ids) for p in rows], sampling, seed=0, version=0)
    finally:
        engine.close()
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    rewards = torch.tensor([task.reward(p, t) for p, t in zip(rows, texts)])
    return {"task": args.task, "task_params": json.loads(args.task_params), "samples": len(rows),
            "mean_reward": rewards.mean().item(), "exact": (rewards == 1).float().mean().item(),
            "groups_with_spread": groups_with_spread(rewards, args.group_size),
            "mean_length": statistics.fmean(len(r) for r in out.response_ids),
            "truncated": 1 - sum(out.finished) / len(rows)}


# ---------------------------------------------------------------- command line

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/science_long"))
    p.add_argument("--tier", default=None, choices=tuple(TIERS), help="1: R, N, C; 2: token_is, icepop, none_1mb; "
                   "all: both; x: the exploratory cell (score centering, where offpolicy has it)")
    p.add_argument("--cells", default=None, help=f"comma-separated cell names ({', '.join(CELLS)}), or 'all' (tiers 1 "
                   "and 2); default: tier 1")
    p.add_argument("--pilot", action="store_true", help="the pilot's cells: tier 1 (R, N, C)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    p.add_argument("--model", default=None, help="model directory; default: SmolLM2-135M-Instruct as "
                   "scripts/smollm2.py builds it")
    p.add_argument("--task", default=RUN["task"])
    p.add_argument("--task-params", default="{}", help="JSON: the task's parameters (the probe and the eval)")
    p.add_argument("--engine", default="hf", choices=("vllm", "hf"), help="hf (default): the GPU machine has no "
                   "vLLM, and on the CPU it holds less memory a run than in-process vLLM")
    p.add_argument("--device", default="cpu", help="the trainer's and the hf engine's device (cpu, cuda, cuda:N)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more train override for every run (repeatable)")
    p.add_argument("--steps", type=int, default=RUN["steps"])
    p.add_argument("--lr", type=float, default=RUN["lr"])
    p.add_argument("--prompts-per-step", type=int, default=RUN["prompts_per_step"])
    p.add_argument("--group-size", type=int, default=RUN["group_size"])
    p.add_argument("--eval-problems", type=int, default=RUN["eval_problems"])
    p.add_argument("--eval-every", type=int, default=RUN["eval_every"])
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's (count: 128)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep a finished run's checkpoints")
    p.add_argument("--untrained", type=int, default=0, metavar="PROMPTS", help="only probe the untrained model: "
                   "PROMPTS prompts × --group-size samples (fp32 engine)")
    p.add_argument("--report", action="store_true", help="only the table, tests and plots from the run directories")
    p.add_argument("--no-start", action="store_true", help="skip the untrained model's eval in the report")
    p.add_argument("--from-json", type=Path, default=None, help="recompute the table and tests from a JSON this "
                   "script wrote (no runs, no model)")
    p.add_argument("--json", type=Path, default=None, help="write the table, tests and per-run numbers here")
    p.add_argument("--plot", type=Path, default=None, help="write the plots here (default OUT/science_long.png)")
    args = p.parse_args(argv)
    if sum(map(bool, (args.tier, args.cells, args.pilot))) > 1:
        p.error("one of --tier, --cells and --pilot")
    if args.cells == "all":
        args.tier = "all"
    names = TIERS[args.tier] if args.tier else TIERS["1"] if args.cells is None else \
        tuple(c.strip() for c in args.cells.split(","))
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        p.error(f"--cells: unknown {', '.join(unknown)}; cells are {', '.join(CELLS)}")
    args.cell_names = names
    args.seed_list = [int(s) for s in args.seeds.split(",")]
    if args.model is None and args.from_json is None:
        script = Path(__file__).resolve().parents[1] / "scripts" / "smollm2.py"
        args.model = subprocess.run([sys.executable, str(script), "--print-path"], check=True, capture_output=True,
                                    text=True).stdout.strip()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        print(report(data["runs"])[2])
        return 0
    if args.untrained:
        print(json.dumps(untrained(args, args.untrained)))
        return 0
    names = [n for n in args.cell_names if n != "centered" or centering_available()]
    if len(names) < len(args.cell_names):
        print("centered: skipped, offpolicy train does not run loss.score_centering yet (issue #56)", flush=True)
    failed = [] if args.report else run_grid([CELLS[n] for n in names], args.seed_list, args)
    start = None if args.no_start else untrained_held_out(args)
    if start:
        print("untrained model, held-out eval: " + ", ".join(f"{k} {v:.3f}" for k, v in start.items()))
    runs = collect(args.out, names, args.seed_list, args.steps)
    table, analysis, text = report(runs)
    print(text)
    print(f"collapse: {COLLAPSE_RULE}")
    plot(runs, args.plot or args.out / "science_long.png", start)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {**RUN, "steps": args.steps, "lr": args.lr, "prompts_per_step": args.prompts_per_step,
                    "group_size": args.group_size, "engine": args.engine, "eval_problems": args.eval_problems,
                    "eval_every": args.eval_every, "task": args.task, "device": args.device}
        args.json.write_text(json.dumps({"settings": settings, "cells": {n: CELLS[n].__dict__ for n in names},
                                         "untrained": start, "collapse_rule": COLLAPSE_RULE, "eval_keys": EVAL_KEYS,
                                         "table": table, "analysis": analysis, "runs": runs}, indent=1))
    if failed:
        print(f"failed runs: {', '.join(failed)} (their logs: OUT/CELL/seedN.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
