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
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from offpolicy.train.evaluate import (COLLAPSE_RULE, EVAL_KEYS, FAILURE_KEYS, collapsed, eval_points, failed_metrics,
                                      primary_metric)

# the registered settings (docs/science.md, "The long-answer experiment"); lr: the pilot's choice
# (the amendment, docs/science.md: policy_kl_rows 0 — two no-grad forwards a step that change no weight;
# checkpoints every 5 steps, the newest kept; gradient checkpointing off, as registered)
# (keys as train spells them since issue #68; the pinned export, which runs the campaign, spells the same settings
# flat: temperature, micro_batch_tokens, gradient_checkpointing)
RUN = {"task": "count", "prompts_per_step": 4, "group_size": 8, "minibatches": 4, "lr": 3e-5, "steps": 40,
       "sampling.temperature": 0.7, "eval_every": 10, "eval_problems": 128, "trainer.micro_batch_tokens": 4096,
       "policy_kl_rows": 0, "checkpoint_every": 5, "checkpoint_keep": 1, "trainer.gradient_checkpointing": False,
       "samples_per_step": 0}
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
    # the amendment's exploratory cells, outside the rule: C's confounds taken apart
    Cell("bypass_02", "bf16", STALENESS, "verl:bypass_ppo_clip"),  # bypass at N's clip ε 0.2 (C: bypass AND ε 0.4)
    Cell("fp32_s4", "fp32", STALENESS, "none"),  # staleness without the bf16 engine (N: dtype AND staleness)
)}
TIERS = {"1": ("R", "N", "C"), "2": ("token_is", "icepop", "none_1mb"), "x": ("centered", "bypass_02", "fp32_s4")}
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
    from offpolicy.core.config import ConfigError, LossConfig
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


def holm(pvalues: dict[str, float | None], family: int | None = None) -> dict[str, float]:
    """Holm's step-down adjustment: sorted p_(1) ≤ … ≤ p_(m), adjusted p_(i) = max over j ≤ i of
    min(1, (m − j + 1)·p_(j)). A test is rejected at family-wise α when its adjusted p < α. ``family``: the size
    registered for the family (m), whatever ran: a test that could not run (p None: a cell without runs) is a
    missing test, kept in the family at p = 1, so a missing cell never makes the others' adjustment smaller."""
    pvalues = {name: 1.0 if p is None else p for name, p in pvalues.items()}
    m = max(family or 0, len(pvalues))
    order = sorted(pvalues, key=pvalues.get)
    running, out = 0.0, {}
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


def smallest_p(n: int, one_sided: bool = True) -> float:
    """The smallest p the exact permutation test of n against n seeds can give: one split of C(2n, n) is the
    observed one (two-sided: it and its mirror)."""
    return (1 if one_sided else 2) / math.comb(2 * n, n)


def min_seeds(alpha: float = ALPHA, one_sided: bool = True) -> int:
    """The fewest seeds a cell for which the exact test can pass at level ``alpha`` at all (smallest p < α): 4 at a
    one-sided 0.05 (1/70); 5 for a test at Holm's first step of a family of 4 (0.05/4: 1/252 at 5, 1/70 at 4)."""
    n = 1
    while smallest_p(n, one_sided) >= alpha:
        n += 1
    return n


def seeds_needed(effect: float, sd: float, alpha: float = ALPHA, power: float = POWER, one_sided: bool = True) -> int:
    """Seeds per cell for ``detectable(sd, n, n, alpha) ≤ effect``, and never fewer than the exact test needs to be
    able to pass at ``alpha`` (``min_seeds``): the normal approximation alone can ask for 2 or 3 seeds, where no
    permutation p is small enough."""
    z = statistics.NormalDist().inv_cdf
    normal = math.ceil(2 * ((z(1 - (alpha if one_sided else alpha / 2)) + z(power)) * sd / effect) ** 2)
    return max(normal, min_seeds(alpha, one_sided))


TIER2_ALPHA = ALPHA / len(TIER2_CONTRASTS)  # the level of Holm's first (strictest) step in tier 2's family


def _splits(n: int):
    """Every way to choose n of 2n seeds as group a: a ``[C(2n, n), 2n]`` 0/1 matrix (numpy)."""
    import numpy as np

    rows = list(itertools.combinations(range(2 * n), n))
    out = np.zeros((len(rows), 2 * n))
    for i, chosen in enumerate(rows):
        out[i, list(chosen)] = 1.0
    return out


def exact_p_many(a, b, splits=None):
    """``permutation_p(a, b, "greater")`` for many simulated experiments at once: ``a``, ``b`` ``[sims, n]`` (numpy),
    every split of the pooled 2n values at once (the same 1e-9 slack)."""
    import numpy as np

    n = a.shape[1]
    splits = _splits(n) if splits is None else splits
    pooled = np.concatenate([a, b], axis=1)  # [sims, 2n]
    total = pooled.sum(1, keepdims=True)
    sums = pooled @ splits.T  # [sims, C(2n, n)]: group a's sum under each split
    diffs = sums / n - (total - sums) / n
    observed = (a.sum(1) / n - b.sum(1) / n)[:, None]
    return (diffs >= observed - 1e-9).mean(1)


def simulated_power(draw, n: int, sims: int = 2000, seed: int = 0) -> dict[str, float]:
    """The registered rule's power at ``n`` seeds a cell, by simulation: ``draw(rng, cell, shape)`` gives a cell's
    primary metrics; each experiment runs the exact one-sided tests of the gate (R − N ≥ 0.10, p < 0.05) and of
    C − N (≥ 0.05, p < 0.05). Returns the share of experiments where the gate passes, where C − N passes, and where
    both do (the "correction matters" path: C − N is tested only after the gate)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    r, nn, c = (np.clip(draw(rng, cell, (sims, n)), 0.0, 1.0) for cell in ("R", "N", "C"))
    splits = _splits(n)
    gate = (r.mean(1) - nn.mean(1) >= GATE) & (exact_p_many(r, nn, splits) < ALPHA)
    rescue = (c.mean(1) - nn.mean(1) >= RESCUE) & (exact_p_many(c, nn, splits) < ALPHA)
    return {"gate": float(gate.mean()), "c_minus_n": float(rescue.mean()), "path": float((gate & rescue).mean())}


# the CPU pilot's primary metrics at one seed a cell (docs/science.md, the pilot): the effect sizes the seed count
# of the amendment was chosen for
PILOT = {"R": 1.000, "N": 0.266, "C": 0.727}


def power_table(ns=(4, 5, 6, 8, 10), sims: int = 2000) -> str:
    """The amendment's power table (``--power``): two models of the cells' spread over seeds, at each seed count.

    * shift: each cell normal around the pilot's value with one SD (0.204, the prior; 0.35, the pilot's N − C
      spread as a guess at a collapse-prone cell), clipped to [0, 1];
    * collapse mixture: a run collapses (primary ~ U(0.2, 0.35), the pilot's N) with probability 0.8 in N and 0.2
      in C, else it lands near the ceiling (U(0.85, 1.0)); R near the ceiling always."""
    lines = ["| model | " + " | ".join(f"n = {n}: gate / C − N / both" for n in ns) + " |",
             "|---|" + "---:|" * len(ns)]
    models = {f"shift, SD {sd}": (lambda sd: lambda rng, cell, shape: rng.normal(PILOT[cell], sd, shape))(sd)
              for sd in (0.204, 0.35)}

    def mixture(rng, cell, shape):
        collapse = {"R": 0.0, "N": 0.8, "C": 0.2}[cell]
        low, high = rng.uniform(0.2, 0.35, shape), rng.uniform(0.85, 1.0, shape)
        return np.where(rng.random(shape) < collapse, low, high)

    import numpy as np

    models["collapse mixture (N 80 %, C 20 %)"] = mixture
    for name, draw in models.items():
        cells = [simulated_power(draw, n, sims) for n in ns]
        lines.append(f"| {name} | " + " | ".join(f"{c['gate']:.2f} / {c['c_minus_n']:.2f} / {c['path']:.2f}"
                                               for c in cells) + " |")
    return "\n".join(lines)


def contrast(name: str, a: list[float], b: list[float], alternative: str, seed: int = 0,
             alpha: float = ALPHA) -> dict[str, Any]:
    """One contrast's numbers: a − b of the means, its bootstrap CI (``LEVEL``), the exact permutation p,
    the pooled SD and the smallest effect these seeds could detect with it at the level ``alpha`` the test runs
    at (tier 2: Holm's first step, α/4) and its sidedness."""
    out: dict[str, Any] = {"contrast": name, "alternative": alternative, "n": [len(a), len(b)], "alpha": alpha,
                           "diff": None, "ci": None, "p": None, "sd": None, "detectable": None}
    if not a or not b:
        return out
    sd = pooled_sd(a, b)
    out.update(diff=mean_diff(a, b), ci=bootstrap_ci(mean_diff, [a, b], seed=seed), p=permutation_p(a, b, alternative),
               sd=sd, detectable=None if sd is None else detectable(sd, len(a), len(b), alpha=alpha,
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
    tier2 = [contrast(name, get(a), get(b), alt, alpha=TIER2_ALPHA) for name, a, b, alt in TIER2_CONTRASTS]
    if any(t["p"] is not None for t in tier2):  # the family is the registered four, a missing test at p = 1
        adjusted = holm({t["contrast"]: t["p"] for t in tier2}, family=len(TIER2_CONTRASTS))
    else:
        adjusted = {}
    for t in tier2:
        t["p_holm"] = adjusted.get(t["contrast"]) if t["p"] is not None else None
    return {"gate": gate, "rescue": rescue, "tier2": tier2, "verdict": verdict(gate, rescue, tier2)}


# the secondary family (the amendment): (metric, a, b) tested one-sided a > b — fewer collapses in R and C than in N,
# a larger AUC in R and C than in N; Holm at 0.05 over the four; beside the verdict, never changing it
SECONDARY_CONTRASTS = (("ever collapsed: N − R", "ever_collapsed", "N", "R"),
                       ("ever collapsed: N − C", "ever_collapsed", "N", "C"),
                       ("AUC: R − N", "auc", "R", "N"), ("AUC: C − N", "auc", "C", "N"))


def secondary(runs: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The secondary family's four tests on the runs' per-seed values (``ever_collapsed``, ``auc``), Holm-adjusted
    as one family of four."""
    def values(cell: str, key: str) -> list[float]:
        seeds = runs.get(cell, {})
        return [seeds[s][key] for s in sorted(seeds, key=int) if seeds[s].get(key) is not None]

    tests = [contrast(name, values(a, key), values(b, key), "greater", alpha=ALPHA / len(SECONDARY_CONTRASTS))
             for name, key, a, b in SECONDARY_CONTRASTS]
    adjusted = holm({t["contrast"]: t["p"] for t in tests}, family=len(tests)) if any(
        t["p"] is not None for t in tests) else {}
    for t in tests:
        t["p_holm"] = adjusted.get(t["contrast"]) if t["p"] is not None else None
    return tests


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
                "sampling.max_tokens": args.max_new_tokens, "model": args.model, "engine.kind": args.engine,
                "engine.dtype": cell.engine_dtype, "max_staleness": cell.staleness, "preset": cell.preset,
                "minibatches": cell.minibatches, "seed": seed, "out_dir": str(run_dir), "trainer.device": args.device,
                "trainer.dtype": "fp32"}  # the trainer in fp32 everywhere: the mismatch is the engine's alone
    extra = [*cell.extra, *args.set]
    if cell.preset == "none":  # an empty correction measures the mismatch (offpolicy/kl_k3 …) and changes no weight
        extra.insert(0, "loss.correction={}")
    return [f"{k}={v}" for k, v in settings.items() if v is not None] + extra


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics rows, one per step, each null read back as the non-finite value it was
    (``offpolicy.train.logger.read_metrics``: a torn last line left out, a resumed step's last row kept)."""
    from offpolicy.train.logger import read_metrics as read

    return read(run_dir)


def finished(run_dir: Path, steps: int) -> bool:
    rows = read_metrics(run_dir)
    return bool(rows) and rows[-1]["step"] >= steps - 1 and "eval/accuracy" in rows[-1]


def train_command(*args: str) -> list[str]:
    """``python -m offpolicy train ARGS`` in this interpreter, without the progress bar (a run's own process)."""
    return [sys.executable, "-m", "offpolicy", "train", "--no-progress", *args]


def command(cell: Cell, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """Resume a cut run (it has a checkpoint), else start it afresh (a directory without one is removed)."""
    if (run_dir / "checkpoints" / "latest").exists():
        return train_command("--resume", str(run_dir), f"steps={args.steps}")  # --steps may have grown since
    shutil.rmtree(run_dir, ignore_errors=True)
    return train_command(*run_overrides(cell, seed, args, run_dir))


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


def run_grid(cells: list[Cell], seeds: list[int], args: argparse.Namespace, on_end=None,
             stop: Callable[[], bool] | None = None, env: dict[str, str] | None = None,
             pairs: list[tuple[Cell, int]] | None = None) -> list[str]:
    """Run every (cell, seed) not yet finished (nor failed by itself), ``args.jobs`` at a time; returns the runs
    that did not finish. ``on_end(name, run_dir, outcome, seconds)`` is told of each run's end (outcome: done,
    failed, stopped); ``stop()`` true: start no more runs; ``env``: the runs' environment (``run_env``'s);
    ``pairs``: exactly these (cell, seed) in this order, in place of ``schedule(cells, seeds)``."""
    todo = [(c, s) for c, s in (pairs if pairs is not None else schedule(cells, seeds))
            if not finished(args.out / c.name / f"seed{s}", args.steps)
            and failure_record(args.out / c.name / f"seed{s}") is None]
    total = len(pairs) if pairs is not None else len(cells) * len(seeds)
    print(f"{total - len(todo)} runs finished already, {len(todo)} to run, {args.jobs} at once", flush=True)
    running: list[tuple[subprocess.Popen, str, float, Any, Path]] = []
    failed = []
    while running or (todo and not (stop and stop())):
        while todo and len(running) < args.jobs and not (stop and stop()):
            cell, seed = todo.pop(0)
            run_dir = args.out / cell.name / f"seed{seed}"
            cmd = command(cell, seed, args, run_dir)
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            log = open(args.out / cell.name / f"seed{seed}.log", "a")
            print(f"start {cell.name} seed {seed}{' (resume)' if '--resume' in cmd else ''}", flush=True)
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or run_env()),
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
            outcome = "done" if ok else end_of(proc.returncode, run_dir)
            print(f"{outcome} {name} in {time.time() - start:.0f} s (exit {proc.returncode}{timing})", flush=True)
            if ok and not args.keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # finished: nothing to resume
            if outcome == "failed":  # by itself: decided now, from the exit status and the trainer's record
                (run_dir.parent / f"{run_dir.name}.failure.json").write_text(json.dumps(
                    {"exit": proc.returncode, "trainer": failure_record(run_dir),
                     "decided": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # never resumed
            if not ok:
                failed.append(name)
            if on_end is not None:
                on_end(name, run_dir, outcome, time.time() - start)
    return failed


OUTSIDE = (130, 137, 143)  # SIGINT, SIGKILL, SIGTERM as a shell reports them (128 + n)


def end_of(returncode: int, run_dir: Path) -> str:
    """How a run that did not finish ended: ``failed`` — by itself: a non-zero exit with the trainer's failure
    record (``failure.json``: the training code raised after logging a step); ``stopped`` — from outside: a
    signal (a negative status, or 128 + n), a memory kill, or an exit without the trainer's record (a crash before
    its first step, a machine not kept). A stopped run is never scored: it resumes from its checkpoint or reruns
    from step 0 at the same seed."""
    if returncode < 0 or returncode in OUTSIDE:
        return "stopped"
    return "failed" if (run_dir / "failure.json").is_file() else "stopped"


# ---------------------------------------------------------------- the report

def run_stats(rows: list[dict[str, Any]], steps: int, failure: dict[str, Any] | None = None,
              start: float | None = None) -> dict[str, Any]:
    """One run's numbers from its metrics rows (as ``read_metrics`` gives them): its evals, the primary metric,
    whether it finished, whether it failed by itself, whether it collapsed, and the curves the plots draw.

    The rules (docs/science.md, the amendment): a run collapsed by ``evaluate.collapsed``, or where a failure metric
    was non-finite at any step (``evaluate.failed_metrics``: the loss, the gradient norm, the reward, the length,
    any eval metric), or where it ended by its own failure (``failure``: the trainer's failure record, or the
    runner's) — then its primary metric is the mean of its last two evals (its last if one; ``start``, the untrained
    model's held-out reward, if none). A run that did not finish and did not fail was stopped from outside: it is
    not scored (``done`` False, no primary), it resumes."""
    evals = eval_points(rows)
    done = bool(rows) and rows[-1]["step"] >= steps - 1 and bool(evals) and evals[-1]["step"] == rows[-1]["step"]
    bad = failed_metrics(rows)
    failed = failure is not None
    primary = primary_metric(evals) if done else None
    if failed and not done:
        primary = (primary_metric(evals) if len(evals) >= 2 else primary_metric(evals * 2) if evals else start)

    def curve(key: str) -> list[float | None]:
        return [_finite(r.get(key)) for r in rows]

    seconds = [r["step_seconds"] for r in rows if isinstance(r.get("step_seconds"), (int, float))]
    kl = [r[MISMATCH] for r in rows if isinstance(r.get(MISMATCH), (int, float)) and math.isfinite(r[MISMATCH])]
    return {"done": done, "failed": failed, "failure": failure, "nonfinite": bad[:20], "steps": len(rows),
            "ever_collapsed": ever_collapsed(evals, steps) if done or failed else None,
            "auc": auc(evals, steps) if done else None,
            "primary": primary, "collapsed": failed or bool(bad) or (done and collapsed(evals)), "evals": evals,
            "mismatch_k3": statistics.fmean(kl) if kl else None,
            "step_seconds_first": seconds[0] if seconds else None,
            "step_seconds_median": statistics.median(seconds) if seconds else None,
            "reward_curve": curve("reward"), "length_curve": curve("response_length"),
            "truncated_curve": curve("truncated_share"), "mismatch_curve": curve(MISMATCH)}


def secondary_steps(steps: int) -> list[int]:
    """The evals the secondary metrics read: every ``eval_every``-th step after step 0, and the last (10, 20, 30, 39
    of 40)."""
    return [*range(RUN["eval_every"], steps - 1, RUN["eval_every"]), steps - 1]


def ever_collapsed(evals: list[dict[str, Any]], steps: int) -> float:
    """The amendment's "ever collapsed", 0 or 1: at some eval of ``secondary_steps`` the held-out reward is ≥ 0.2
    below the maximum of the run's evals up to and including it, or more than half of its greedy answers are
    truncated, or an eval metric is non-finite. A run that failed by itself counts 1."""
    from offpolicy.train.evaluate import COLLAPSE_DROP, COLLAPSE_TRUNCATED

    best = -math.inf
    marks = set(secondary_steps(steps))
    for e in evals:
        reward = e.get("eval/accuracy", math.nan)
        if not all(math.isfinite(v) for k, v in e.items() if k != "step"):
            return 1.0
        best = max(best, reward)
        if e["step"] in marks and (reward <= best - COLLAPSE_DROP + 1e-9
                                   or e.get("eval/truncated_share", 0.0) > COLLAPSE_TRUNCATED):
            return 1.0
    return 0.0


def auc(evals: list[dict[str, Any]], steps: int) -> float | None:
    """The amendment's AUC: the trapezoid of the held-out reward over the evals of ``secondary_steps``, divided by
    their span (29 for 40 steps): a mean reward that weighs the whole run, not its end. None where an eval is
    missing; a non-finite reward counts 0, as in the primary metric."""
    at = {e["step"]: e.get("eval/accuracy", math.nan) for e in evals}
    marks = secondary_steps(steps)
    if any(m not in at for m in marks) or len(marks) < 2:
        return None
    ys = [at[m] if math.isfinite(at[m]) else 0.0 for m in marks]
    area = sum((ys[i] + ys[i + 1]) / 2 * (marks[i + 1] - marks[i]) for i in range(len(marks) - 1))
    return area / (marks[-1] - marks[0])


MISMATCH = "offpolicy/kl_k3_start"  # k3 of π_θ at the step's start against μ, whatever the anchor (the amendment)


def _finite(value: Any) -> float | None:
    """A curve's point: None where the metric is absent or non-finite (a gap in the plot, null in the JSON)."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def summarize(runs: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per cell: finished seeds, the primary metric's mean and SD over them, collapses, the last eval's
    truncated share and length, the mean mismatch k3, the median step time."""
    table = []
    for cell, seeds in runs.items():
        done = [r for r in seeds.values() if (r["done"] or r.get("failed")) and r["primary"] is not None]
        primary = [r["primary"] for r in done]
        last = [r["evals"][-1] for r in done if r["evals"]]

        def mean(values):
            values = [v for v in values if v is not None]
            return statistics.fmean(values) if values else None

        table.append({"cell": cell, "runs": len(seeds), "finished": len(done),
                      "primary": mean(primary), "primary_sd": statistics.stdev(primary) if len(primary) > 1 else None,
                      "collapsed": sum(r["collapsed"] for r in seeds.values()),
                      "failed": sum(bool(r.get("failed")) for r in seeds.values()),
                      "truncated": mean([e.get("eval/truncated_share") for e in last]),
                      "length": mean([e.get("eval/response_length") for e in last]),
                      "answer_logprob": mean([e.get("eval/answer_logprob") for e in last]),
                      "mismatch_k3": mean([r["mismatch_k3"] for r in done]),
                      "step_seconds": mean([r["step_seconds_median"] for r in seeds.values()])})
    return table


def primaries(runs: dict[str, dict[str, dict[str, Any]]], failed_at: float | None = None) -> dict[str, list[float]]:
    """Each cell's primary metric over its scored seeds (finished, or failed by themselves), in seed order;
    ``failed_at``: a failed run's value replaced by this (the report's row with failures at 0)."""
    def value(run: dict[str, Any]) -> float:
        return failed_at if failed_at is not None and run.get("failed") else run["primary"]
    return {cell: [value(seeds[s]) for s in sorted(seeds, key=int)
                   if (seeds[s]["done"] or seeds[s].get("failed")) and seeds[s]["primary"] is not None]
            for cell, seeds in runs.items()}


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ci(ci) -> str:
    return "–" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def markdown(table: list[dict[str, Any]], analysis: dict[str, Any]) -> str:
    lines = ["| cell | seeds scored | primary (mean ± SD) | collapsed (failed) | last eval: truncated | length | "
             "answer log-prob | mismatch k3 (π_θ vs μ) | s/step |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in table:
        lines.append(f"| {row['cell']} | {row['finished']}/{row['runs']} | {_fmt(row['primary'], '.3f')} ± "
                     f"{_fmt(row['primary_sd'], '.3f')} | {row['collapsed']}/{row['runs']} ({row.get('failed', 0)}) | "
                     f"{_fmt(row['truncated'], '.2f')} | {_fmt(row['length'], '.1f')} | "
                     f"{_fmt(row['answer_logprob'], '.1f')} | {_fmt(row['mismatch_k3'], '.1e')} | "
                     f"{_fmt(row['step_seconds'], '.1f')} |")
    lines += ["", "| contrast | seeds | difference | 90 % bootstrap CI | exact p | Holm p | SD | detectable (at α) |",
              "|---|---|---:|---|---:|---:|---:|---:|"]
    for c in [analysis["gate"], analysis["rescue"], *analysis["tier2"]]:
        side = "≥" if c["alternative"] == "greater" else "two-sided"
        lines.append(f"| {c['contrast']} ({side}) | {c['n'][0]} v {c['n'][1]} | {_fmt(c['diff'], '+.3f')} | "
                     f"{_ci(c['ci'])} | {_fmt(c['p'], '.4f')} | {_fmt(c.get('p_holm'), '.4f')} | "
                     f"{_fmt(c['sd'], '.3f')} | {_fmt(c['detectable'], '.3f')} ({c.get('alpha', ALPHA):.4g}) |")
    share = analysis["rescue"].get("recovered_share")
    lines += ["", f"recovered share (C − N)/(R − N): {_fmt(share, '.2f')} (90 % CI "
                  f"{_ci(analysis['rescue'].get('recovered_ci'))})", *analysis["verdict"]]
    return "\n".join(lines)


def failure_record(run_dir: Path) -> dict[str, Any] | None:
    """A run's own failure, as recorded when it ended: the runner's ``RUN.failure.json`` beside the run directory
    (exit status and the trainer's record), else the trainer's ``failure.json`` inside it; None: it did not fail."""
    for path in (run_dir.parent / f"{run_dir.name}.failure.json", run_dir / "failure.json"):
        if path.is_file():
            return json.loads(path.read_text())
    return None


def collect(out: Path, cells: list[str], seeds: list[int] | None, steps: int,
            start: float | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Every run directory under ``out`` of the named cells (and seeds, when given), seeds as strings (JSON's keys);
    ``start``: the untrained model's held-out reward (a failed run's primary metric where it never evaluated)."""
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for cell in cells:
        for run_dir in sorted((out / cell).glob("seed*")):
            if not run_dir.is_dir():
                continue
            seed = int(run_dir.name[4:])
            if seeds is None or seed in seeds:
                stats = run_stats(read_metrics(run_dir), steps, failure_record(run_dir), start)
                record = run_dir / "provenance.json"  # the trainer's blocks, one a session (offpolicy.measure.provenance)
                stats["provenance"] = json.loads(record.read_text())["sessions"] if record.is_file() else None
                runs.setdefault(cell, {})[str(seed)] = stats
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
    """The table, the registered analysis and their markdown, from per-run stats (run directories or a JSON). Where
    a run failed by itself, the analysis is repeated with those runs at 0 (the amendment's extra row), beside the
    registered one, which keeps their last evals."""
    table = summarize(runs)
    analysis = analyse(primaries(runs))
    text = markdown(table, analysis)
    analysis["secondary"] = secondary(runs)
    text += "\n\nsecondary family (Holm over four; beside the verdict, never changing it):\n" + "\n".join(
        f"{t['contrast']}: {_fmt(t['diff'], '+.3f')}, exact p {_fmt(t['p'], '.4f')}, Holm p {_fmt(t['p_holm'], '.4f')}"
        for t in analysis["secondary"])
    if any(r.get("failed") for seeds in runs.values() for r in seeds.values()):
        at_zero = analyse(primaries(runs, failed_at=0.0))
        analysis["failed_at_zero"] = at_zero
        text += "\n\nwith the runs that failed by themselves at 0:\n" + "\n".join(
            f"{c['contrast']}: {_fmt(c['diff'], '+.3f')}, exact p {_fmt(c['p'], '.4f')}"
            for c in (at_zero["gate"], at_zero["rescue"])) + "\n" + "\n".join(at_zero["verdict"])
    return table, analysis, text


# ---------------------------------------------------------------- the confirmatory campaign (the amendment)
#
# Tier 1 at seeds 1-8 on the CPU, from one pinned commit (docs/science.md, "The amendment"). The campaign's
# directory in the repository (``docs/science_long``) holds PINNED (the commit), LOCK.json (the stack it runs on),
# DEVIATIONS.md, and ``runs/CELL/seedN/``: each finished (or failed) run's record, committed at once. The runs
# themselves (checkpoints, logs) live under the cache directory, outside the work tree. Blinded: nothing here
# prints, plots or summarises an outcome of a confirmatory run until all of tier 1's records are in.

CAMPAIGN_CELLS = TIERS["1"]
CAMPAIGN_SEEDS = tuple(range(1, 9))  # seed 0 is the pilot's: its runs are deterministic, so it would replay them
CAMPAIGN_RUNS = len(CAMPAIGN_CELLS) * len(CAMPAIGN_SEEDS)
RECORD_FILES = ("metrics.jsonl", "config.yaml", "provenance.json", "failure.json")  # what a run's record keeps
OUTCOME_KEYS = ("reward", "eval/", "response_length", "truncated", "kl_", "offpolicy/", "policy/", "primary")


class CampaignError(RuntimeError):
    """The campaign cannot go on as pinned (another commit, another stack, a record that differs): say why."""


def cache_root() -> Path:
    """offpolicy's cache directory (``$OFFPOLICY_CACHE``, else ``~/.cache/offpolicy``) / science_long."""
    return Path(os.environ.get("OFFPOLICY_CACHE") or Path.home() / ".cache" / "offpolicy") / "science_long"


def pinned(campaign: Path) -> tuple[str, dict[str, str]]:
    """The pinned commit and the lock (the versions of torch, transformers and vLLM the runs use)."""
    commit = (campaign / "PINNED").read_text().split()[0]
    return commit, json.loads((campaign / "LOCK.json").read_text())


def check_provenance(block: dict[str, Any], commit: str, lock: dict[str, str], tree: str | None = None) -> list[str]:
    """What differs between a provenance block (``offpolicy.measure.provenance.block``) and the pin: the commit, the code
    tree's hash (``tree``: the export's), the module root (an export's ``src/offpolicy``), the locked versions."""
    code, versions = block["code"], block["versions"]
    problems = []
    if code.get("commit") != commit or code.get("source") != "export":
        problems.append(f"code from {code.get('source')} commit {code.get('commit')}, not the export of {commit}")
    if tree is not None and code.get("tree_hash") != tree:
        problems.append(f"code tree {code.get('tree_hash')} is not the pinned export's {tree}")
    if not str(code.get("module_root", "")).endswith(f"export-{commit[:12]}/src/offpolicy"):
        problems.append(f"offpolicy imported from {code.get('module_root')}, not the pinned export")
    for name, want in lock.items():
        if versions.get(name) != want:
            problems.append(f"{name} {versions.get(name)}, locked at {want}")
    return problems


def campaign_records(campaign: Path) -> dict[tuple[str, int], Path]:
    """The committed records: (cell, seed) → its directory (``runs/CELL/seedN`` with a ``record.json``)."""
    return {(d.parent.name, int(d.name[4:])): d for d in sorted((campaign / "runs").glob("*/seed*"))
            if (d / "record.json").is_file()}


def tier1_records(campaign: Path) -> dict[tuple[str, int], Path]:
    """The records that count towards tier 1's 24: R, N and C at seeds 1-8 (a stray or later tier's never unblinds)."""
    return {key: d for key, d in campaign_records(campaign).items()
            if key[0] in CAMPAIGN_CELLS and key[1] in CAMPAIGN_SEEDS}


def commit_record(repo: Path, path: Path, message: str) -> None:
    """``git add`` and ``git commit`` of ``path`` alone (other staged work stays staged), retried while another
    git command holds the index."""
    for attempt in range(30):
        add = subprocess.run(["git", "-C", str(repo), "add", "--", str(path)], capture_output=True, text=True)
        done = add.returncode == 0 and subprocess.run(
            ["git", "-C", str(repo), "commit", "-q", "--no-verify", "-m", message, "--", str(path)],
            capture_output=True, text=True).returncode == 0
        if done:
            return
        time.sleep(2 + attempt)
    raise CampaignError(f"could not commit {path} (git's index stayed locked?)")


def keep_record(campaign: Path, cell: str, seed: int, run_dir: Path, outcome: str, seconds: float, commit: str,
                lock: dict[str, str], tree: str, overrides: list[str]) -> Path:
    """Copy a run that ended (finished, or failed by itself) into ``runs/CELL/seedN`` with its ``record.json``
    (cell, seed, outcome, wall time, the overrides it ran with, the failure record), after checking every session
    of its provenance against the pin (``CampaignError`` where one differs: the record is not kept)."""
    sessions = json.loads((run_dir / "provenance.json").read_text())["sessions"]
    problems = [f"session from step {s['from_step']}: {p}" for s in sessions for p in check_provenance(s, commit, lock,
                                                                                                    tree)]
    if problems:
        raise CampaignError(f"{cell}/seed{seed} ran off the pin: " + "; ".join(problems))
    dest = campaign / "runs" / cell / f"seed{seed}"
    dest.mkdir(parents=True, exist_ok=True)
    for name in RECORD_FILES:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, dest / name)
    (dest / "record.json").write_text(json.dumps({
        "cell": cell, "seed": seed, "outcome": outcome, "wall_seconds": round(seconds, 1), "pinned": commit,
        "overrides": overrides, "failure": failure_record(run_dir),
        "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
    return dest


def campaign_args(args: argparse.Namespace) -> argparse.Namespace:
    """The registered settings for every confirmatory run (RUN, the hf engine, the CPU), whatever else was typed."""
    fixed = argparse.Namespace(**vars(args))
    fixed.steps, fixed.lr = RUN["steps"], RUN["lr"]
    fixed.prompts_per_step, fixed.group_size = RUN["prompts_per_step"], RUN["group_size"]
    fixed.eval_problems, fixed.eval_every, fixed.max_new_tokens = RUN["eval_problems"], RUN["eval_every"], None
    fixed.engine, fixed.device, fixed.set, fixed.keep_checkpoints = "hf", "cpu", [], False
    fixed.out = cache_root() / "runs"
    return fixed


def run_campaign(args: argparse.Namespace) -> int:
    """Run the campaign's missing runs from this pinned export, ``--jobs`` at once, seed-major, each finished run's
    record committed at once (``--commit``). Refuses unless this script is the export of PINNED (its module root,
    tree hash and the locked versions). Stops starting runs once ``CAMPAIGN_STOP`` exists in the cache directory
    (or ``--until`` passes); the runs going on are stopped from outside (SIGTERM: each checkpoints and resumes)."""
    from offpolicy.measure import provenance
    campaign = args.campaign.resolve()
    if (campaign / "STOPPED").exists() or stop_commits(campaign):
        raise CampaignError("the campaign was stopped early (docs/science_long/STOPPED, committed): no run starts "
                            "after that decision")
    commit, lock = pinned(campaign)
    block = provenance.block()
    tree = block["code"]["tree_hash"]
    problems = check_provenance(block, commit, lock, tree)
    if problems:
        raise CampaignError("this runner is not the pinned export (scripts/science_campaign.sh start runs it): "
                            + "; ".join(problems))
    fixed = campaign_args(args)
    fixed.model = fixed.model or default_model()
    records = tier1_records(campaign)
    todo = [(c, s) for s in CAMPAIGN_SEEDS for c in CAMPAIGN_CELLS if (c, s) not in records]
    print(f"campaign at {commit[:12]}: {len(records)} of {CAMPAIGN_RUNS} records in, {len(todo)} left, "
          f"{fixed.jobs} at once", flush=True)
    stop_file = cache_root() / "CAMPAIGN_STOP"
    deadline = time.time() + args.until * 3600 if args.until else None

    def stop() -> bool:
        return stop_file.exists() or (deadline is not None and time.time() > deadline)

    problem: list[str] = []

    def on_end(name: str, run_dir: Path, outcome: str, seconds: float) -> None:
        if outcome == "stopped":
            return  # resumes from its checkpoint (or reruns from step 0) next time
        cell, seed = name.split("/")[0], int(name.split("/seed")[1])
        overrides = run_overrides(CELLS[cell], seed, fixed, run_dir)
        try:
            dest = keep_record(campaign, cell, seed, run_dir, outcome, seconds, commit, lock, tree, overrides)
        except CampaignError as err:  # no more runs: the pin is not what ran
            problem.append(str(err))
            return
        if args.commit:
            commit_record(Path(args.commit), dest, f"science campaign: the record of {cell} seed {seed} "
                          f"({len(tier1_records(campaign))} of {CAMPAIGN_RUNS}; pinned {commit[:12]})")
        print(f"recorded {name} ({len(tier1_records(campaign))} of {CAMPAIGN_RUNS})", flush=True)

    def halt() -> bool:
        return bool(problem) or stop()

    env = run_env()
    env["PYTHONPATH"] = str(provenance.module_root().parent)  # the runs import the export, as this runner does
    for cell, seed in todo:  # ended before its record was kept (the runner was stopped in between): keep it now
        run_dir = fixed.out / cell / f"seed{seed}"
        if finished(run_dir, fixed.steps) or failure_record(run_dir) is not None:
            on_end(f"{cell}/seed{seed}", run_dir, "done" if failure_record(run_dir) is None else "failed", 0.0)
    todo = [(c, s) for c, s in todo if (c, s) not in tier1_records(campaign)]
    failed = run_grid([], [], fixed, on_end, halt, env, pairs=[(CELLS[c], s) for c, s in todo])  # seed-major
    print(f"campaign: {len(tier1_records(campaign))} of {CAMPAIGN_RUNS} records in"
          f"{'; not finished: ' + ', '.join(failed) if failed else ''}", flush=True)
    if problem:
        raise CampaignError("; ".join(problem))
    return 0


def campaign_status(campaign: Path) -> dict[str, Any]:
    """Done / running / left, seconds a step and the time left — never an outcome (the runs' metrics are read for
    their step count and ``step_seconds`` alone)."""
    records = tier1_records(campaign)
    out_dir = cache_root() / "runs"
    running, seconds, steps_left = [], [], 0
    for seed in CAMPAIGN_SEEDS:
        for cell in CAMPAIGN_CELLS:
            if (cell, seed) in records:
                continue
            rows = read_metrics(out_dir / cell / f"seed{seed}") if (out_dir / cell / f"seed{seed}").is_dir() else []
            if rows:
                running.append(f"{cell}/seed{seed} at step {len(rows)} of {RUN['steps']}")
            seconds += [r["step_seconds"] for r in rows if isinstance(r.get("step_seconds"), (int, float))]
            steps_left += RUN["steps"] - len(rows)
    for d in records.values():
        rows = read_metrics(d)
        seconds += [r["step_seconds"] for r in rows if isinstance(r.get("step_seconds"), (int, float))]
    per_step = statistics.median(seconds) if seconds else None
    return {"done": len(records), "of": CAMPAIGN_RUNS, "started": running,
            "left": CAMPAIGN_RUNS - len(records) - len(running), "seconds_a_step": per_step,
            "hours_left_at_2_lanes": None if per_step is None else round(steps_left * per_step / 2 / 3600, 1)}


# What a rerun is not expected to repeat: the wall clock, memory, and the split of an asynchronous run's staleness
# into in-flight and in-queue (``staleness/in_flight``, ``staleness/in_queue``: when the engine thread finished a batch
# against the trainer's progress). Everything else a step logs (samples, rewards, losses, the mismatch, the evals, the
# staleness itself) follows from the seed and the code.
VOLATILE = ("time/", "memory/", "step_seconds", "generate/tokens_per_s", "staleness/in_flight", "staleness/in_queue")


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit as read back (a NaN equals a NaN: the same failure logged the same way)."""
    nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return nan or a == b


def replay_differences(recorded: list[dict[str, Any]], replayed: list[dict[str, Any]],
                       steps: int) -> list[tuple[int, int, list[str]]]:
    """Step by step over the first ``steps`` rows: (step, keys compared, the keys whose values differ, or that one
    row has and the other lacks), ``VOLATILE`` keys aside. Values are compared bit for bit (NaN equals NaN) and
    never returned: a replay of a confirmatory run tells only whether it repeated, not what it measured."""
    out = []
    for want, got in itertools.zip_longest(recorded[:steps], replayed[:steps]):
        if want is None or got is None:
            step = (want or got)["step"]
            out.append((step, 0, ["<the row itself>"]))
            continue
        keys = sorted(k for k in set(want) | set(got) if not k.startswith(VOLATILE))
        out.append((want["step"], len(keys), [k for k in keys if k not in want or k not in got
                                               or not _same(want[k], got[k])]))
    return out


def campaign_replay(campaign: Path, name: str, steps: int, export: Path | None = None) -> int:
    """Rerun the first ``steps`` steps of a committed run from the pinned export (``export``: its directory; default
    the one ``scripts/science_campaign.sh export`` lays in the cache) with the record's own overrides and the runner's
    environment (one thread), then compare its metrics with the record's row by row (``replay_differences``). Prints
    which keys differ at which step, never a value (blinding). Exit 0: every step repeated; 1: some differ; 3: cannot
    replay (no such record, no export, the replay ran off the pin)."""
    from offpolicy.measure import provenance

    cell, _, seed = name.partition("/seed")
    record_dir = campaign / "runs" / cell / f"seed{seed}"
    if not (record_dir / "record.json").is_file():
        print(f"replay: no record {name} under {campaign / 'runs'} (CELL/seedN, e.g. R/seed1)", file=sys.stderr)
        return 3
    commit, lock = pinned(campaign)
    export = (export or cache_root() / f"export-{commit[:12]}").resolve()
    if not (export / "COMMIT").is_file() or (export / "COMMIT").read_text().split()[0] != commit:
        print(f"replay: {export} is not the export of the pinned {commit[:12]} "
              "(bash scripts/science_campaign.sh export lays it)", file=sys.stderr)
        return 3
    record = json.loads((record_dir / "record.json").read_text())
    recorded = read_metrics(record_dir)
    if len(recorded) < steps:
        print(f"replay: {name} has {len(recorded)} steps, fewer than the {steps} asked", file=sys.stderr)
        return 3
    first = json.loads((record_dir / "provenance.json").read_text())["sessions"][0]
    here = provenance.cpu()
    cpu_note = ("the recorded CPU kind" if (here.get("model"), here.get("avx512_bf16"))
                == (first["cpu"].get("model"), first["cpu"].get("avx512_bf16"))
                else f"NOT the recorded CPU kind ({first['cpu'].get('model')}, avx512_bf16 "
                     f"{first['cpu'].get('avx512_bf16')}): bit-identity is not expected")
    out = cache_root() / "replay" / f"{cell}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    overrides = [o for o in record["overrides"] if not o.startswith("out_dir=")] + [f"out_dir={out}"]
    env = run_env()
    env["PYTHONPATH"] = str(export / "src")
    print(f"replay {name}: its first {steps} steps from the export of {commit[:12]} on {cpu_note}", flush=True)
    proc = subprocess.Popen(train_command(*overrides), env=env, cwd=export, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)

    def replayed_rows() -> list[dict[str, Any]]:
        return read_metrics(out) if (out / "metrics.jsonl").is_file() else []

    try:
        while proc.poll() is None and len(replayed_rows()) < steps:
            time.sleep(2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # the rows are written; the rest of the run is not needed
        err = proc.communicate()[1]
    replayed = replayed_rows()
    if len(replayed) < steps:
        print(f"replay: the run ended after {len(replayed)} steps (exit {proc.returncode}):\n{err[-2000:]}",
              file=sys.stderr)
        return 3
    sessions = json.loads((out / "provenance.json").read_text())["sessions"]
    problems = [p for s in sessions for p in check_provenance(s, commit, lock)]
    if problems:
        print("replay: ran off the pin: " + "; ".join(problems), file=sys.stderr)
        return 3
    diffs = replay_differences(recorded, replayed, steps)
    for step, compared, keys in diffs:
        print(f"step {step}: " + (f"identical on all {compared} keys" if not keys else
                                  f"{len(keys)} of {compared} keys differ: {', '.join(keys)}"))
    shutil.rmtree(out, ignore_errors=True)
    same = not any(keys for _, _, keys in diffs)
    print(f"replay {name}: {'repeated bit for bit' if same else 'did NOT repeat'} "
          f"({len(diffs)} steps; {', '.join(VOLATILE)} aside)")
    return 0 if same else 1


# Stopping early (the amendment): only the calendar or the run count may stop the campaign. The decision is a
# committed file, docs/science_long/STOPPED, one line "YYYY-MM-DD calendar|run-count: why" (scripts/science_campaign.sh
# stop-early writes and commits it); no run starts after it, and the report then reads seeds 1..k, the largest k at
# which all three cells have a record for every seed (seed-major order: the seeds the campaign ran first), k ≥ 5.
STOPPED_REASONS = ("calendar", "run-count")
TRUNCATED_MIN_SEEDS = 5
_STOPPED_LINE = re.compile(r"(\d{4}-\d{2}-\d{2})\S*\s+(" + "|".join(STOPPED_REASONS) + r"):\s*(\S.*)")


def _git(campaign: Path, *args: str) -> subprocess.CompletedProcess:
    """git in the campaign's directory; ``CampaignError`` where there is no git to ask."""
    try:
        return subprocess.run(["git", "-C", str(campaign), *args], capture_output=True, text=True, check=False)
    except OSError as err:
        raise CampaignError(f"git is needed to read the campaign's history: {err}") from err


def stop_commits(campaign: Path) -> list[str]:
    """The commits that touched the campaign's ``STOPPED``, newest first (none outside a git checkout)."""
    log = _git(campaign, "log", "--format=%H", "--", "STOPPED")
    return log.stdout.split() if log.returncode == 0 else []


def early_stop(campaign: Path) -> tuple[str, set[tuple[str, int]]] | None:
    """The campaign's early stop: ``STOPPED``'s line and the records committed when it was (cell, seed); None where
    the campaign was never stopped. ``CampaignError`` where the decision is not one commit of that file alone, left as
    it is (removed, changed or relabelled after it: the campaign stays stopped and says so), or names a reason other
    than the calendar or the run count."""
    path = campaign / "STOPPED"
    commits = stop_commits(campaign)
    if not commits and not path.exists():
        return None
    if not commits:
        raise CampaignError(f"{path} is not committed: commit the decision to stop before the report reads a record "
                            "(scripts/science_campaign.sh stop-early does both)")
    if len(commits) > 1 or not path.is_file():
        raise CampaignError(f"{path} was {'removed' if not path.is_file() else 'changed'} after the campaign was "
                            f"stopped early ({len(commits)} commits touch it): a stop is one commit, never undone")
    prefix = _git(campaign, "rev-parse", "--show-prefix").stdout.strip()
    touched = _git(campaign, "show", "--name-only", "--format=", commits[0]).stdout.split()
    if touched != [f"{prefix}STOPPED"]:
        raise CampaignError(f"the commit that stopped the campaign ({commits[0][:12]}) changed more than STOPPED: "
                            f"{', '.join(touched)}")
    if _git(campaign, "diff", "--quiet", "HEAD", "--", "STOPPED").returncode != 0:
        raise CampaignError(f"{path} differs from its commit: a stop is one commit, never edited")
    line = (path.read_text().strip().splitlines() or [""])[0].strip()
    if not _STOPPED_LINE.fullmatch(line):
        raise CampaignError(f"{path} must read 'YYYY-MM-DD calendar|run-count: why' (only the calendar or the run "
                            f"count may stop the campaign, never its results); it reads {line!r}")
    tree = _git(campaign, "ls-tree", "-r", "--name-only", commits[0], "--", "runs").stdout.split()
    at_stop = {(parts[-3], int(parts[-2][4:])) for parts in (name.split("/") for name in tree)
               if len(parts) >= 4 and parts[-1] == "record.json" and parts[-2].startswith("seed")}
    return line, at_stop


def complete_seeds(records: dict[tuple[str, int], Path]) -> int:
    """The largest k such that every tier-1 cell has a record for each of the seeds ``CAMPAIGN_SEEDS[:k]``."""
    k = 0
    while k < len(CAMPAIGN_SEEDS) and all((c, CAMPAIGN_SEEDS[k]) in records for c in CAMPAIGN_CELLS):
        k += 1
    return k


def untrained_reward(campaign: Path, records: dict[tuple[str, int], Path]) -> tuple[float | None, str]:
    """The untrained model's held-out reward, which a run that failed before two evals scores (the amendment):
    ``untrained.json`` in the campaign's directory where there is one, else the median of the records' step-0 evals
    (each run evaluates the untrained model before its first update). Read only once the report is unblinded."""
    path = campaign / "untrained.json"
    if path.is_file():
        return json.loads(path.read_text()).get("eval/accuracy"), "untrained.json"
    first = [rows[0]["eval/accuracy"] for rows in (read_metrics(d) for d in records.values())
             if rows and rows[0].get("step") == 0 and _finite(rows[0].get("eval/accuracy")) is not None]
    return (statistics.median(first), f"the median step-0 eval of {len(first)} records") if first else (None, "none")


def campaign_report(campaign: Path, json_path: Path | None, plot_path: Path | None = None) -> int:
    """The registered report from the committed records, once all of tier 1's are in, or once the campaign was
    stopped early by a committed ``STOPPED`` (then at seeds 1..k of the records committed when it stopped, labelled
    truncated, with the δ at k). Exit 2 while blinded (before either, or where fewer than 5 seeds are complete in all
    three cells), 3 where the stop is not one commit of ``STOPPED`` alone, as it stands, naming a registered reason."""
    records = tier1_records(campaign)
    seeds, truncated = list(CAMPAIGN_SEEDS), None
    try:
        stopped = early_stop(campaign)
    except CampaignError as err:
        print(f"science campaign: {err}", file=sys.stderr)
        return 3
    if stopped is None and len(records) < CAMPAIGN_RUNS:
        print(f"blinded: {len(records)} of {CAMPAIGN_RUNS} tier-1 records are in; the report waits for all of them",
              file=sys.stderr)
        return 2
    if stopped is not None:  # the records committed when the campaign stopped: nothing that landed after counts
        stop, at_stop = stopped
        k = complete_seeds({key: d for key, d in records.items() if key in at_stop})
        if k < TRUNCATED_MIN_SEEDS:
            print(f"blinded: the campaign stopped early ({stop}) with {k} seeds complete in all three cells; the "
                  f"registration gives a truncated verdict only at k ≥ {TRUNCATED_MIN_SEEDS}, so there is none",
                  file=sys.stderr)
            return 2
        seeds = list(CAMPAIGN_SEEDS[:k])
        truncated = None if k == len(CAMPAIGN_SEEDS) else {"k": k, "of": len(CAMPAIGN_SEEDS), "stopped": stop}
    start, start_from = untrained_reward(campaign, {key: d for key, d in records.items() if key[1] in seeds})
    runs = collect(campaign / "runs", list(CAMPAIGN_CELLS), seeds, RUN["steps"], start)
    table, analysis, text = report(runs)
    if truncated:
        delta = {c["contrast"]: c["detectable"] for c in (analysis["gate"], analysis["rescue"])}
        truncated["detectable"] = delta
        analysis["truncated"] = truncated
        text = (f"TRUNCATED at k = {truncated['k']} of {truncated['of']} seeds a cell (seeds "
                f"{seeds[0]}–{seeds[-1]}; {stop}). The smallest effects these seeds detect (one-sided α {ALPHA}, "
                f"power {POWER}): " + ", ".join(f"{name} δ {_fmt(d, '.3f')}" for name, d in delta.items())
                + "\n\n" + text)
    print(text)
    print(f"collapse: {COLLAPSE_RULE}")
    if plot_path:
        plot(runs, plot_path, None if start is None else {"eval/accuracy": start})
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"settings": RUN, "cells": {n: CELLS[n].__dict__ for n in CAMPAIGN_CELLS},
                                         "pinned": pinned(campaign)[0], "collapse_rule": COLLAPSE_RULE,
                                         "seeds": seeds, "truncated": truncated,
                                         "untrained": {"eval/accuracy": start, "from": start_from},
                                         "table": table, "analysis": analysis, "runs": runs}, indent=1))
    return 0


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
        sampling = SamplingConfig(max_tokens=args.max_new_tokens or task.max_new_tokens, temperature=RUN["sampling.temperature"])
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
                   "all: both; x: the exploratory cells (score centering where offpolicy has it; bypass at ε 0.2; an fp32 "
                   "engine at staleness 4)")
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
    p.add_argument("--power", action="store_true", help="only the amendment's power simulation (no runs, no model)")
    p.add_argument("--campaign", type=Path, default=None, metavar="DIR", help="the confirmatory campaign's directory "
                   "(docs/science_long): with --run, --status or --report (blinded until all its records are in)")
    p.add_argument("--run", action="store_true", help="--campaign: run its missing runs (from the pinned export only)")
    p.add_argument("--status", action="store_true", help="--campaign: done / running / left, s a step, hours left")
    p.add_argument("--replay", default=None, metavar="CELL/seedN", help="--campaign: rerun a committed run's first "
                   "--replay-steps steps from the pinned export and say, key by key, whether they repeated (no value)")
    p.add_argument("--replay-steps", type=int, default=2, metavar="K")
    p.add_argument("--export", type=Path, default=None, metavar="DIR", help="--replay: the pinned export's directory "
                   "(default: the one scripts/science_campaign.sh lays in the cache)")
    p.add_argument("--commit", default=None, metavar="REPO", help="--campaign --run: commit each record in this "
                   "checkout at once")
    p.add_argument("--until", type=float, default=None, metavar="HOURS", help="--campaign --run: start no run after "
                   "this many hours (the calendar, never the results, may stop a campaign)")
    p.add_argument("--plot", type=Path, default=None, help="write the plots here (default OUT/science_long.png; "
                   "--campaign --report: only where given, once the report is unblinded)")
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
    if args.campaign is not None and sum(map(bool, (args.run, args.status, args.report, args.replay))) != 1:
        p.error("--campaign: one of --run, --status, --report and --replay")
    if args.replay_steps < 1:
        p.error("--replay-steps: at least 1")
    if args.model is None and args.from_json is None and args.campaign is None and not args.power:
        args.model = default_model()
    return args


def default_model() -> str:
    """SmolLM2-135M-Instruct's directory as scripts/smollm2.py builds it (once, in offpolicy's cache)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "smollm2.py"
    return subprocess.run([sys.executable, str(script), "--print-path"], check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.power:
        print(power_table())
        return 0
    if args.campaign is not None:
        if args.status:
            print(json.dumps(campaign_status(args.campaign), indent=1))
            return 0
        if args.report:
            return campaign_report(args.campaign, args.json, args.plot)
        if args.replay:
            return campaign_replay(args.campaign.resolve(), args.replay, args.replay_steps, args.export)
        try:
            return run_campaign(args)
        except CampaignError as err:
            print(f"science campaign: {err}", file=sys.stderr)
            return 3
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        print(report(data["runs"])[2])
        return 0
    if args.untrained:
        print(json.dumps(untrained(args, args.untrained)))
        return 0
    # the blinding holds on every path: the grid's --report (or a run) reads neither the campaign's records nor its
    # runs in the cache (in progress, or ended and not yet recorded)
    held = sorted(f"{c}/{d.parent.name}" for c in args.cell_names for d in (args.out / c).glob("seed*/record.json"))
    if held:
        print(f"{args.out} holds the confirmatory campaign's records ({', '.join(held[:3])}"
              f"{' …' if len(held) > 3 else ''}): read them with --campaign {args.out.parent} --report (blinded until "
              f"all {CAMPAIGN_RUNS} are in)", file=sys.stderr)
        return 2
    if args.out.resolve().is_relative_to(cache_root().resolve()):
        print(f"{args.out} is the confirmatory campaign's own run directory ({cache_root()}): its runs are read only "
              "through their committed records, by --campaign docs/science_long --report", file=sys.stderr)
        return 2
    names = [n for n in args.cell_names if n != "centered" or centering_available()]
    if len(names) < len(args.cell_names):
        print("centered: skipped, offpolicy train does not run loss.score_centering yet (issue #56)", flush=True)
    failed = [] if args.report else run_grid([CELLS[n] for n in names], args.seed_list, args)
    start = None if args.no_start else untrained_held_out(args)
    if start:
        print("untrained model, held-out eval: " + ", ".join(f"{k} {v:.3f}" for k, v in start.items()))
    runs = collect(args.out, names, args.seed_list, args.steps, start and start.get("eval/accuracy"))
    table, analysis, text = report(runs)
    print(text)
    print(f"collapse: {COLLAPSE_RULE}")
    plot(runs, args.plot or args.out / "science_long.png", start)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {**RUN, "steps": args.steps, "lr": args.lr, "prompts_per_step": args.prompts_per_step,
                    "group_size": args.group_size, "engine": args.engine, "eval_problems": args.eval_problems,
                    "eval_every": args.eval_every, "task": args.task, "device": args.device,
                    "set": list(args.set)}  # every --set override, as typed (the runs' own: provenance.json)
        args.json.write_text(json.dumps({"settings": settings, "cells": {n: CELLS[n].__dict__ for n in names},
                                         "untrained": start, "collapse_rule": COLLAPSE_RULE, "eval_keys": EVAL_KEYS,
                                         "table": table, "analysis": analysis, "runs": runs}, indent=1))
    if failed:
        print(f"failed runs: {', '.join(failed)} (their logs: OUT/CELL/seedN.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
