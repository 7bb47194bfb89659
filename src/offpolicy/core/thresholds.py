"""Bounds chosen from the data (issue #12 item 2, issue #14 M2PO): the numbers behind
``{rule: ess, target}``, ``{rule: quantile, q}`` and the ``m2`` rejection rule.

Each function takes the 1-D fp32 values of one set of *units* (valid tokens, non-empty rows or
segments) and returns a plain number that the fixed-bound code then applies, so a data-chosen
bound is exactly "a fixed bound whose value was read off the batch":

    quantile  upper: v_(⌈q·n⌉)      lower: v_(⌊q·n⌋+1)        (v sorted ascending, indices in [1, n])
    ess       the largest c with  ESS(c) = (Σ min(w_i, c))² / (n Σ min(w_i, c)²) ≥ target
    m2        with s sorted descending and k = min{i : mean(s_{i+1..n}) < τ}: keep m2 < s_k

Per call by default: the bound needs the whole set of units, and a call sees one micro-batch on
one rank. ``offpolicy.core.step.resolve_thresholds`` computes them once over every micro-batch of an
optimizer step and every rank of a process group (an all-gather of the unit values) and returns
the config with the numbers filled in, which then gives every micro-batch the same bound.

A leaf below ``correction``: it imports only ``config`` (for the bound types), never
``correction`` or ``losses``, so the step-level helper that runs ``correct`` lives above both.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from offpolicy.core.config import EssBound, QuantileBound

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
    if isinstance(bound, QuantileBound):
        return quantile_high(values, bound.q) if side == "high" else quantile_low(values, bound.q)
    if isinstance(bound, EssBound):
        return ess_cap(values, bound.target)
    return bound
