"""Step-level helpers: what one optimizer step fixes over ALL its micro-batches and ranks before
the first micro-batch's forward, so that a step split into calls behaves like one big batch.

``resolve_thresholds`` turns every data-chosen bound (issue #12: ``{rule: quantile, q}``,
``{rule: ess, target}``; issue #14: the ``m2`` rule) into the plain number it takes over the
whole step — the same formulas as ``offpolicy.core.thresholds``, applied to the union of the step's
units — and fixes ``weight.normalize``'s mean weight for the step (issue #32):

    quantile  upper: v_(⌈q·n⌉)      lower: v_(⌊q·n⌋+1)        (v sorted ascending, indices in [1, n])
    ess       the largest c with  ESS(c) = (Σ min(w_i, c))² / (n Σ min(w_i, c)²) ≥ target
    m2        with s sorted descending and k = min{i : mean(s_{i+1..n}) < τ}: keep m2 < s_k
    normalize  w̄ = Σ_{b, t} w_t / Σ_b N_b   (tokens; rows' mean weights at sequence levels)

It sits above ``correction`` and ``losses`` (it runs ``correct`` stage by stage and accepts what
``policy_loss`` accepts), beside ``losses.with_global_normalizer``, its companion for the
denominator; ``thresholds`` stays a leaf below ``correction``, so imports run one way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from offpolicy.core.config import CorrectionConfig, DivergenceRule, LossConfig, M2Rule, rule_name
from offpolicy.core.correction import (
    chosen_band,
    correct,
    normalizer,
    record_bound,
    rule_units,
    weight_sum_and_count,
    weight_units,
)
from offpolicy.core.losses import as_loss_config
from offpolicy.core.metrics import Metrics
from offpolicy.core.thresholds import m2_cut


def _gather(values: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate ``values`` (1-D) of every rank of ``group`` (itself when not distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return values
    size = torch.tensor([values.numel()], device=values.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])


def resolve_thresholds(
    config: Any,
    micro_batches: Iterable[Mapping[str, torch.Tensor | None]],
    *,
    group: Any = None,
    metrics: Metrics | None = None,
):
    """``config`` with every data-chosen bound replaced by the number it takes over ALL the
    micro-batches of one optimizer step and all ranks of ``group`` — so that a step split into
    micro-batches (and ranks) rejects and truncates exactly like one big batch. Call it once per
    step, before the micro-batches' forwards, and pass the result to each ``policy_loss`` call.

    ``weight.normalize`` is fixed the same way: the step's mean weight (with the resolved bounds,
    over every micro-batch and rank) goes into ``weight.normalize_mean``, so every micro-batch
    divides by it (per call, each would divide by its own mean).

    With ``metrics``, what a per-call bound records is recorded once for the step (reducer mean):
    ``reject/<i>_<stat>_<level>/low|high`` and ``weight_low|high`` (the chosen numbers), and for
    an m2 rule ``reject/<i>_m2_token/m2_before|m2_after`` (mean (log ρ)² of the units it sees and
    keeps) — under the ORIGINAL rule's name, while the calls with the returned config report the
    rule's masked fractions under ``<i>_k2_token``.

    Stages are resolved in the order ``correct`` applies them: each rule on the mask its
    predecessors leave (``reject_mode``), then the weight on the surviving mask. A quantile or
    ESS bound becomes its number; an ``m2`` rule becomes the equivalent fixed rule
    ``{stat: k2, level: token, high: h/2}`` (keep ½(log ρ)² ≤ h/2 ⇔ (log ρ)² ≤ h), so the metric
    namespace of that rule reads ``k2`` and its m2_before/after metrics are not reported.

    Each micro-batch maps the tensors ``correct`` reads (``old_logprobs``, ``rollout_logprobs``,
    ``mask``, and ``logprobs`` / ``advantages`` where the anchor or a rule needs them). Cost: one
    ``correct`` per stage and micro-batch, and an all-gather of one float per unit (token or row)
    per data-dependent stage.

    Accepts a LossConfig, a CorrectionConfig, or what ``policy_loss``'s ``config=`` accepts, and
    returns the same kind (a LossConfig for anything but a CorrectionConfig).
    """
    as_corr = isinstance(config, CorrectionConfig)
    loss_cfg = None if as_corr else as_loss_config(config)
    corr: CorrectionConfig | None = config if as_corr else loss_cfg.correction
    if corr is None or not corr.step_dependent:
        return config if as_corr else loss_cfg
    batches = [dict(mb) for mb in micro_batches]
    if not batches:
        raise ValueError("resolve_thresholds: no micro-batches given")

    def run(cfg: CorrectionConfig):
        return [correct(mb.get("old_logprobs"), mb.get("rollout_logprobs"), mb["mask"], cfg,
                        logprobs=mb.get("logprobs"), advantages=mb.get("advantages")) for mb in batches]

    rules = list(corr.reject)
    # the runs that read a stage's units: no weight, no later rule, and (fewer rules than an integer
    # denominator counts) the valid tokens as the count, which these runs never read
    clamp_cfg = corr.model_copy(update={"weight": None, "reject": [], "denominator": "fixed"})
    for i, rule in enumerate(rules):
        if not (isinstance(rule, M2Rule) or getattr(rule, "adaptive", False)):
            continue
        outs = run(clamp_cfg.model_copy(update={"reject": rules[:i]}))
        # one set of units (and one all-gather) serves both sides of the band
        parts = [rule_units(rule, o.log_ratio, (o.mask if corr.reject_mode == "sequential" else o.valid_mask).bool(),
                            corr.log_clamp) for o in outs]
        values = _gather(torch.cat([p.reshape(-1).to(parts[0].device) for p in parts]), group)
        name = f"reject/{rule_name(i, rule)}/"
        if isinstance(rule, M2Rule):
            cut = m2_cut(values, rule.high)
            if math.isinf(cut):  # nothing to drop: the largest value keeps every unit, and a config holds no inf
                cut = float(values.max()) if values.numel() else 0.0
            rules[i] = DivergenceRule(stat="k2", level="token", high=cut / 2)
            if metrics is not None:
                kept = values[values * 0.5 <= cut / 2]  # the k2 rule's own comparison
                for key, part in (("m2_before", values), ("m2_after", kept)):
                    record_bound(metrics, name + key, float(part.double().mean()) if part.numel() else None,
                                 values.device)
        else:  # no unit anywhere: nothing to reject
            rules[i] = rule.model_copy(update=chosen_band(rule, values, fill_empty=True, metrics=metrics, key=name))
    fixed = corr.model_copy(update={"reject": rules})
    w = corr.weight
    if w is not None and w.adaptive and corr.anchor != "rollout":
        outs = run(fixed.model_copy(update={"weight": None}))
        parts = [weight_units(w, o.log_ratio, o.mask.bool(), corr.log_clamp, mb["mask"])
                 for o, mb in zip(outs, batches)]
        values = _gather(torch.cat([p.reshape(-1).to(parts[0].device) for p in parts]), group)
        band = chosen_band(w, values, fill_empty=False, metrics=metrics, key="weight_")
        fixed = fixed.model_copy(update={"weight": w.model_copy(update=band)})
    w = fixed.weight
    if w is not None and w.normalize and w.normalize_mean is None and corr.anchor != "rollout":
        # the step's mean weight: Σ over every micro-batch (and rank) of the weights normalize would
        # average, with the bounds fixed above, over Σ of their counts (correction.normalize_weights)
        outs = run(fixed.model_copy(update={"weight": w.model_copy(update={"normalize": False})}))
        level = "token" if w.level == "segment" else w.level
        stats = sum(weight_sum_and_count(o.weights, o.mask.bool(), level).to(outs[0].weights.device) for o in outs)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        fixed = fixed.model_copy(update={"weight": w.model_copy(update={"normalize_mean": normalizer(stats)})})
    if as_corr:
        return fixed
    return LossConfig(**{**loss_cfg.model_dump(exclude={"correction"}), "correction": fixed})
