"""Bounds chosen from the data (issue #12 item 2, issue #14 M2PO): the numbers behind
``{rule: ess, target}``, ``{rule: quantile, q}`` and the ``m2`` rejection rule.

Each function takes the 1-D fp32 values of one set of *units* (valid tokens, non-empty rows or
segments) and returns a plain number that the fixed-bound code then applies, so a data-chosen
bound is exactly "a fixed bound whose value was read off the batch":

    quantile  upper: v_(⌈q·n⌉)      lower: v_(⌊q·n⌋+1)        (v sorted ascending, indices in [1, n])
    ess       the largest c with  ESS(c) = (Σ min(w_i, c))² / (n Σ min(w_i, c)²) ≥ target
    m2        with s sorted descending and k = min{i : mean(s_{i+1..n}) < τ}: keep m2 < s_k

Per call by default: the bound needs the whole set of units, and a call sees one micro-batch on
one rank. ``resolve_thresholds`` computes them once over every micro-batch of an optimizer step
and every rank of a process group (an all-gather of the unit values) and returns the config with
the numbers filled in, which then gives every micro-batch the same bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

_EPS = 1e-9  # q·n = 9.000000000000002 must give index 9, not 10


def _f32_down(x: float) -> float:
    """The largest fp32 value ≤ x (a cap rounded up by fp32 could break the ESS target)."""
    t = torch.tensor(x, dtype=torch.float32, device="cpu")  # a Python number: never the default device
    if float(t) > x:
        t = torch.nextafter(t, torch.tensor(-math.inf, dtype=torch.float32, device="cpu"))
    return float(t)


def quantile_high(values: torch.Tensor, q: float) -> float | None:
    """v_(⌈q·n⌉): at most (1 − q)·n values lie above it. None for no values."""
    n = values.numel()
    if n == 0:
        return None
    k = min(max(math.ceil(q * n - _EPS), 1), n)
    return float(torch.sort(values.reshape(-1)).values[k - 1])


def quantile_low(values: torch.Tensor, q: float) -> float | None:
    """v_(⌊q·n⌋+1): at most q·n values lie below it. None for no values."""
    n = values.numel()
    if n == 0:
        return None
    k = min(max(math.floor(q * n + _EPS) + 1, 1), n)
    return float(torch.sort(values.reshape(-1)).values[k - 1])


def ess(weights: torch.Tensor) -> float:
    """Normalised effective sample size (Σw)² / (n Σw²) in float64 (1.0 for no weights)."""
    w = weights.double().reshape(-1)
    s2 = float((w * w).sum())
    return 1.0 if w.numel() == 0 or s2 == 0 else float(w.sum()) ** 2 / (w.numel() * s2)


def ess_cap(weights: torch.Tensor, target: float) -> float | None:
    """The largest cap c with ESS(min(w, c)) ≥ ``target`` (rounded down to fp32), or max w when
    the raw weights already reach it. None for no weights.

    ESS(c) is non-increasing in c — dESS/dc ∝ Σ_{w_i < c} w_i (w_i − c) ≤ 0 — so with w sorted
    ascending, ESS at the candidate caps c = w_(k) is a non-increasing sequence: the last k that
    passes brackets the answer in [w_(k), w_(k+1)], where the k+1 smallest weights are fixed and
    m = n − k − 1 are capped, and f(c) = (A + m·c)² − target·n·(B + m·c²) (A, B the sums of the
    fixed weights and their squares) changes sign once: bisection in float64 finds its root.
    """
    w = torch.sort(weights.double().reshape(-1)).values
    n = w.numel()
    if n == 0:
        return None
    if ess(w) >= target:
        return float(w[-1])
    # exclusive prefix sums: A_k = Σ_{i<k} w_i, B_k = Σ_{i<k} w_i²
    zero = torch.zeros(1, dtype=w.dtype, device=w.device)
    a = torch.cat([zero, torch.cumsum(w, 0)[:-1]])
    b = torch.cat([zero, torch.cumsum(w * w, 0)[:-1]])
    capped = torch.arange(n, 0, -1, dtype=w.dtype, device=w.device)  # n − k weights sit at the cap w_k
    s1 = a + capped * w
    s2 = b + capped * w * w
    passes = (s1 * s1 >= target * n * s2) & (s2 > 0)
    idx = torch.nonzero(passes).reshape(-1)
    if idx.numel() == 0:
        return _f32_down(float(w[0]))
    k = int(idx[-1])
    if k == n - 1:  # cannot happen (ESS(w_max) < target), kept for safety
        return float(w[-1])
    lo, hi = float(w[k]), float(w[k + 1])
    a_k, b_k, m = float(a[k + 1]), float(b[k + 1]), n - k - 1

    def f(c: float) -> float:
        return (a_k + m * c) ** 2 - target * n * (b_k + m * c * c)

    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if f(mid) >= 0:
            lo = mid
        else:
            hi = mid
    return max(_f32_down(lo), float(w[k]))


def m2_cut(m2: torch.Tensor, high: float) -> float:
    """Upper bound h (keep m2 ≤ h) of the M2PO rule: with s the m2 values sorted descending and
    k = min{i : mean(s_{i+1..n}) < high}, h is the largest fp32 below s_k (so every value tied
    with s_k goes too and the kept mean stays < high); k = 0 gives h = +inf (nothing dropped);
    when no suffix is below ``high`` only the smallest value (and its ties) is kept, h = s_n."""
    n = m2.numel()
    if n == 0:
        return math.inf
    s = torch.sort(m2.reshape(-1).float(), descending=True).values
    suffix_mean = torch.flip(torch.cumsum(torch.flip(s.double(), [0]), 0), [0]) / torch.arange(
        n, 0, -1, dtype=torch.float64, device=s.device)
    below = torch.nonzero(suffix_mean < high).reshape(-1)
    if below.numel() == 0:
        return float(s[-1])
    k = int(below[0])
    if k == 0:
        return math.inf
    return float(torch.nextafter(s[k - 1], torch.tensor(-math.inf, dtype=s.dtype, device=s.device)))


def bound_value(bound: Any, values: torch.Tensor, side: str) -> float | None:
    """The number an adaptive ``bound`` (EssBound / QuantileBound) takes on ``values``; a plain
    number or None passes through."""
    from offpolicy.config import EssBound, QuantileBound

    if isinstance(bound, QuantileBound):
        return quantile_high(values, bound.q) if side == "high" else quantile_low(values, bound.q)
    if isinstance(bound, EssBound):
        return ess_cap(values, bound.target)
    return bound


# =========================================================================== whole steps, all ranks
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
):
    """``config`` with every data-chosen bound replaced by the number it takes over ALL the
    micro-batches of one optimizer step and all ranks of ``group`` — so that a step split into
    micro-batches (and ranks) rejects and truncates exactly like one big batch. Call it once per
    step, before the micro-batches' forwards, and pass the result to each ``policy_loss`` call.

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
    from offpolicy.config import CorrectionConfig, DivergenceRule, LossConfig, M2Rule
    from offpolicy.correction import chosen_band, correct, rule_units, weight_units
    from offpolicy.losses import as_loss_config

    as_corr = isinstance(config, CorrectionConfig)
    loss_cfg = None if as_corr else as_loss_config(config)
    corr: CorrectionConfig | None = config if as_corr else loss_cfg.correction
    if corr is None or not corr.data_dependent:
        return config if as_corr else loss_cfg
    batches = [dict(mb) for mb in micro_batches]
    if not batches:
        raise ValueError("resolve_thresholds: no micro-batches given")

    def run(cfg: CorrectionConfig):
        return [correct(mb.get("old_logprobs"), mb.get("rollout_logprobs"), mb["mask"], cfg,
                        logprobs=mb.get("logprobs"), advantages=mb.get("advantages")) for mb in batches]

    rules = list(corr.reject)
    clamp_cfg = corr.model_copy(update={"weight": None, "reject": []})
    for i, rule in enumerate(rules):
        if not (isinstance(rule, M2Rule) or getattr(rule, "adaptive", False)):
            continue
        outs = run(clamp_cfg.model_copy(update={"reject": rules[:i]}))
        # one set of units (and one all-gather) serves both sides of the band
        parts = [rule_units(rule, o.log_ratio, (o.mask if corr.reject_mode == "sequential" else o.valid_mask).bool(),
                            corr.log_clamp) for o in outs]
        values = _gather(torch.cat([p.reshape(-1).to(parts[0].device) for p in parts]), group)
        if isinstance(rule, M2Rule):
            cut = m2_cut(values, rule.high)
            rules[i] = DivergenceRule(stat="k2", level="token", high=cut / 2)
        else:  # no unit anywhere: nothing to reject
            rules[i] = rule.model_copy(update=chosen_band(rule, values, fill_empty=True))
    fixed = corr.model_copy(update={"reject": rules})
    w = corr.weight
    if w is not None and w.adaptive and corr.anchor != "rollout":
        outs = run(fixed.model_copy(update={"weight": None}))
        parts = [weight_units(w, o.log_ratio, o.mask.bool(), corr.log_clamp, mb["mask"])
                 for o, mb in zip(outs, batches)]
        values = _gather(torch.cat([p.reshape(-1).to(parts[0].device) for p in parts]), group)
        fixed = fixed.model_copy(update={"weight": w.model_copy(update=chosen_band(w, values, fill_empty=False))})
    if as_corr:
        return fixed
    return LossConfig(**{**loss_cfg.model_dump(exclude={"correction"}), "correction": fixed})
