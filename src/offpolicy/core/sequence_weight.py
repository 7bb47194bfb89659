"""The sequence weight Π_t ρ_t before truncation, and a pre-check for the presets built on it (issue #56).

A Π-ρ correction (``weight.level: sequence``, or a ``ratio`` rejection rule at ``level: sequence``) reads one
number per row, log W_i = Σ_t log ρ_t over the row's n_i counted tokens. Its expected value is n_i · m,
m = E[log ρ_t] the batch's mean log-ratio per token: it drifts linearly with the length, so over long rows
a small per-token bias carries almost every row past the preset's bound C (NeMo-RL #2269: a sequence
weight of 0.0596 at step 1 and a gradient norm of 8.6e-5; our GPU grid's TRL sequence mask at
staleness 4). The pre-check compares, per row,

    predicted:  n_i · m            against  log high  (m > 0)  or  log low  (m < 0)
    measured:   Σ_t log ρ_t        against  [log low, log high]

and warns when the predicted or the measured share of rows outside the band is above one half: the preset
would clamp (``truncate``) or mask (``mask``, a rejection rule) most rows, so the update is mostly the
bound, not the data. A bound chosen from the data (``{rule: quantile}``, ``{rule: ess}``) has no fixed
log C and is left out (``skipped``).

The distribution users ask to see before the truncation (NeMo-RL #3900) is ``log_weight`` / ``weight``:
the min, median and max over rows of log W_i, and of W_i = exp(clamp(log W_i, ±60)) in fp32 (the median
is the lower median, one row's own value). Everything is computed in log space; ``exp`` only of clamped
logs (docs/estimators.md, "Sequence weights that saturate").
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from offpolicy.core import ops
from offpolicy.core.config import CorrectionConfig, RatioRule, is_adaptive

log = logging.getLogger(__name__)

MOST = 0.5  # "most rows": the share above which the pre-check warns


@dataclass(frozen=True)
class SequenceBound:
    """One fixed bound of a Π-ρ stage: where it comes from (``weight`` or ``reject/<i>``), what it does to a
    row outside it (``clamp``: truncation; ``mask``: weight 0 or the row dropped) and the band [low, high]."""

    source: str
    action: str
    low: float | None
    high: float | None

    def describe(self) -> str:
        band = f"[{'0' if self.low is None else f'{self.low:g}'}, {'∞' if self.high is None else f'{self.high:g}'}]"
        return f"{self.source} ({self.action}) Π ρ outside {band}"


def sequence_bounds(cfg: CorrectionConfig) -> tuple[list[SequenceBound], list[str]]:
    """The fixed bounds of ``cfg``'s Π-ρ stages, and a note for each stage whose bound is chosen from the
    data (no fixed log C to compare with). Empty for a correction with no Π-ρ stage."""
    bounds, skipped = [], []

    def number(x: Any) -> float | None:
        return float(x) if isinstance(x, (int, float)) else None

    for i, rule in enumerate(cfg.reject):
        if isinstance(rule, RatioRule) and rule.level == "sequence":
            if rule.adaptive:
                skipped.append(f"reject/{i}: a bound chosen from the data")
            else:
                bounds.append(SequenceBound(f"reject/{i}", "mask", number(rule.low), number(rule.high)))
    w = cfg.weight
    if w is not None and w.level == "sequence" and cfg.anchor != "rollout":
        if is_adaptive(w.low) or is_adaptive(w.high):
            skipped.append("weight: a bound chosen from the data")
        elif w.low is not None or w.high is not None:
            bounds.append(SequenceBound("weight", "clamp" if w.mode == "truncate" else "mask",
                                        number(w.low), number(w.high)))
    return bounds, skipped


def is_sequence_level(cfg: CorrectionConfig | None) -> bool:
    """Whether ``cfg`` has a Π-ρ stage (a sequence-level weight or ratio rule), fixed bound or not."""
    if cfg is None:
        return False
    bounds, skipped = sequence_bounds(cfg)
    return bool(bounds or skipped) or (cfg.weight is not None and cfg.weight.level == "sequence")


def row_sums(log_ratio: torch.Tensor, mask: torch.Tensor, log_clamp: float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log W_i = Σ_t clamp(log ρ_t, ±L), n_i) per row ``[B]`` fp32, over ``mask``'s tokens where log ρ is
    finite (a token outside a top-k/top-p support has none); L = ``ops.effective_log_clamp(log_clamp)``."""
    keep = mask.bool() & torch.isfinite(log_ratio)
    clamp = ops.effective_log_clamp(log_clamp)
    lr = torch.where(keep, log_ratio.float().clamp(-clamp, clamp), 0.0)
    return lr.sum(dim=-1), keep.sum(dim=-1).float()


def distribution(log_weight: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """min, median (lower), max of log W_i and of W_i = exp(clamp(log W_i, ±60)) over the non-empty rows, and
    their lengths' median; NaN everywhere without a non-empty row."""
    rows = lengths > 0
    out: dict[str, float] = {"rows": float(rows.sum())}
    values = log_weight[rows].float()
    for name, fn in (("min", torch.min), ("median", torch.median), ("max", torch.max)):
        x = fn(values) if values.numel() else torch.tensor(math.nan)
        out[f"log_{name}"] = float(x)
        out[name] = float(ops.safe_exp(x, None))
    out["length_median"] = float(torch.median(lengths[rows])) if values.numel() else math.nan
    return out


def shares(bound: SequenceBound, log_weight: torch.Tensor, lengths: torch.Tensor, mean_log_ratio: float
           ) -> dict[str, float]:
    """The shares of non-empty rows outside ``bound``: ``predicted`` from n_i · m (module doc), ``measured``
    from log W_i. A bound ≤ 0 on the low side (no lower bound) is open."""
    rows = lengths > 0
    n = max(int(rows.sum()), 1)
    log_low = math.log(bound.low) if bound.low is not None and bound.low > 0 else -math.inf
    log_high = math.log(bound.high) if bound.high is not None else math.inf
    drift = lengths.double() * mean_log_ratio  # n_i · m
    measured = ((log_weight.double() < log_low) | (log_weight.double() > log_high)) & rows
    predicted = ((drift < log_low) | (drift > log_high)) & rows
    return {"predicted_outside": float(predicted.sum()) / n, "measured_outside": float(measured.sum()) / n,
            "log_low": log_low, "log_high": log_high}


def precheck(log_ratio: torch.Tensor, mask: torch.Tensor, corrections: dict[str, CorrectionConfig]
             ) -> dict[str, Any]:
    """The pre-check of every Π-ρ correction of ``corrections`` (name → config) on one batch of log ρ
    ``[B, T]`` (log π_train − log μ; non-finite tokens left out), and the distribution of log W_i.

    Returns ``{"mean_log_ratio": m, "distribution": …, "presets": [{"preset", "bound", "action",
    "predicted_outside", "measured_outside", "warn"}], "skipped": [...], "warnings": [lines]}``."""
    log_weight, lengths = row_sums(log_ratio, mask)
    tokens = float(lengths.sum())
    m = float(log_weight.double().sum()) / tokens if tokens else 0.0
    rows, skipped, warnings = [], [], []
    for name, cfg in corrections.items():
        bounds, notes = sequence_bounds(cfg)
        skipped += [f"{name} {note}" for note in notes]
        for bound in bounds:
            # each preset's own clamp: a per-token clamp below |log ρ| changes its row sum
            own, _ = row_sums(log_ratio, mask, cfg.log_clamp) if cfg.log_clamp is not None else (log_weight, None)
            s = shares(bound, own, lengths, m)
            warn = max(s["predicted_outside"], s["measured_outside"]) > MOST
            rows.append({"preset": name, "bound": bound.describe(), "action": bound.action,
                         "predicted_outside": s["predicted_outside"], "measured_outside": s["measured_outside"],
                         "warn": warn})
            if warn:
                warnings.append(warning(name, bound, s, m, float(lengths[lengths > 0].median())
                                        if bool((lengths > 0).any()) else 0.0))
    return {"mean_log_ratio": m, "distribution": distribution(log_weight, lengths), "presets": rows,
            "skipped": skipped, "warnings": warnings}


def warning(name: str, bound: SequenceBound, s: dict[str, float], m: float, median_length: float) -> str:
    """One line: which preset, which bound, both shares, and the numbers behind the prediction."""
    verb = "clamp" if bound.action == "clamp" else "mask"
    side = s["log_high"] if m > 0 else s["log_low"]
    return (f"{name}: {bound.describe()} — the sequence weight Π ρ would {verb} most rows: predicted "
            f"{s['predicted_outside']:.0%} (length × mean log ρ = {median_length:.0f} × {m:.3g} = "
            f"{median_length * m:.3g} at the median length, against log C = {side:.3g}), measured "
            f"{s['measured_outside']:.0%}. A token-level or geometric-mean weight does not grow with the length "
            "(docs/estimators.md, \"Sequence weights that saturate\")")


def warn_once(lines: list[str], seen: set[str], console=None) -> None:
    """Each pre-check line once a run (by its preset and bound, the text before " — "): on ``console`` in
    yellow, else as a logging warning."""
    for line in lines:
        key = line.split(" — ")[0]
        if key in seen:
            continue
        seen.add(key)
        if console is None:
            log.warning("sequence-weight pre-check: %s", line)
        else:
            from rich.text import Text

            console.print(Text(f"warning: {line}", style="yellow"))
