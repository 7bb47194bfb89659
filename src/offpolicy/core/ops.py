"""Numerics shared by the correction, the losses and the metrics — and nothing else.

Every helper here is NaN-safe with respect to the mask: values at masked-out positions are
*selected away* with ``torch.where`` rather than multiplied by zero, because ``nan * 0 = nan``.
All arithmetic is fp32 (the callers cast on entry).
"""

from __future__ import annotations

import math

import torch

# exp(88.72) overflows fp32 — but a weight is then multiplied by A and summed over tokens, so a
# bound just under 88.7 still let a few such terms overflow the loss to ±inf (issue #9 item 8).
# exp(60) ≈ 1.1e26 leaves 12 orders of magnitude for |A|·(token count) before fp32's 3.4e38.
# Frameworks that do not clamp their log-ratios (TRL, OpenRLHF; ``log_clamp: null``) get this
# bound instead of none: it changes no ratio below 1e26, and keeps ``inf`` out of the loss.
FP32_EXP_LIMIT = 60.0


def effective_log_clamp(log_clamp: float | None) -> float:
    """The bound actually applied before ``exp``: min(``log_clamp``, 60); ``None`` gives 60."""
    return FP32_EXP_LIMIT if log_clamp is None else min(float(log_clamp), FP32_EXP_LIMIT)


def safe_exp(log_x: torch.Tensor, log_clamp: float | None) -> torch.Tensor:
    """exp(clamp(log_x, −L, L)) — the only way this package exponentiates a log-ratio."""
    bound = effective_log_clamp(log_clamp)
    return torch.exp(log_x.clamp(-bound, bound))


def k3(log_ratio: torch.Tensor, log_clamp: float | None) -> torch.Tensor:
    """k3 = ρ − 1 − log ρ = expm1(log ρ) − log ρ, ρ = exp(clamp(log ρ, −L, L)).

    ``expm1``, never ``exp(x) − 1``: near ρ = 1 (where an fp32 trainer and engine sit) exp rounds ρ to
    fp32's spacing at 1, ~1.2e-7, while k3 ≈ (log ρ)²/2 is far smaller — the float form reads a floor of
    ~1e-9 where the value is 1e-11 (issue #30). ``expm1`` keeps its relative precision there.
    """
    bound = effective_log_clamp(log_clamp)
    return torch.expm1(log_ratio.clamp(-bound, bound)) - log_ratio


BINARY_KL_EPS = 1e-6  # OpenRLHF 0.11's clamp of both probabilities, keeps every log finite
_LOG_EPS, _LOG_1M_EPS = math.log(BINARY_KL_EPS), math.log1p(-BINARY_KL_EPS)


def binary_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(Bern(p) ‖ Bern(q)) of the sampled token from its log-probs, p and q clamped to
    [1e-6, 1 − 1e-6] (as OpenRLHF 0.11 does), in fp32 and clamped at zero:

        bkl = max(0, p·d + (1 − p)·log1p(−q·expm1(d) / (1 − q))),   d = log p − log q

    which is p log(p/q) + (1 − p) log((1 − p)/(1 − q)) written so that no term rounds a
    probability first: (1 − p)/(1 − q) = 1 + (q − p)/(1 − q) and q − p = −q·expm1(d), and
    1 − q = −expm1(log q). For p ≈ q the two terms are of size |d| with opposite signs and cancel
    to ≈ q d²/(2(1 − q)); the textbook fp32 form p·log(p/q) + … rounds each term at ~6e-8 and
    comes out negative about half the time (OpenRLHF #1354 rejected valid tokens on such values
    under a band with lower bound 0). This form's rounding scales with |d|, and the clamp
    removes what is left, so the value is never negative."""
    lp = log_p.float().clamp(_LOG_EPS, _LOG_1M_EPS)
    lq = log_q.float().clamp(_LOG_EPS, _LOG_1M_EPS)
    d = lp - lq
    p, q = torch.exp(lp), torch.exp(lq)
    second = torch.log1p(-q * torch.expm1(d) / -torch.expm1(lq))
    return (p * d - torch.expm1(lp) * second).clamp(min=0.0)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x over positions where ``mask`` is true; NaN/inf at masked-out positions are ignored."""
    selected = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m / max(Σ m, 1): 0 (not NaN) for an empty selection — callers report emptiness."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_max(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max of x over the mask; −inf where the selection is empty."""
    neg_inf = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    selected = torch.where(mask, x, neg_inf)
    return selected.amax() if dim is None else selected.amax(dim=dim)


def masked_min(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """min of x over the mask; +inf where the selection is empty."""
    pos_inf = torch.full((), float("inf"), dtype=x.dtype, device=x.device)
    selected = torch.where(mask, x, pos_inf)
    return selected.amin() if dim is None else selected.amin(dim=dim)


def row_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, geometric: bool) -> torch.Tensor:
    """Sequence log-ratio per row, ``[B, T] → [B]``, *unclamped*.

    product:   Σ_t m_t · log ρ_t
    geometric: (Σ_t m_t · log ρ_t) / max(n_valid, 1)
    """
    total = masked_sum(log_ratio, mask, dim=-1)  # [B]
    if not geometric:
        return total
    return total / mask.sum(dim=-1).clamp(min=1).to(total.dtype)


def in_band(x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """Boolean ``low ≤ x ≤ high`` (inclusive; a ``None`` bound is open)."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if low is not None:
        keep &= x >= low
    if high is not None:
        keep &= x <= high
    return keep


def broadcast_rows(row_values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B] → [B, T]`` view matching ``like``."""
    return row_values.unsqueeze(-1).expand_as(like)
