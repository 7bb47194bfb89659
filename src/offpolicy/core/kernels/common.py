"""What several implementations share: the autograd Functions of the analytic backward and
the row aggregation with its derivative.

A fast implementation computes, without an autograd graph, the per-token loss ℓ_t and its
derivative c_t = ∂ℓ_t/∂log π_θ(y_t); ``CoefLoss``/``CoefTokens`` attach that derivative to
π_θ so that ``backward`` is one [B, T] product: grad · c_t · ∂L/∂ℓ_t.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from offpolicy.core.config import LossConfig

RATIO_LOG_CLAMP = 20.0  # PPO's own ratio π_θ/π_old: exp(clamp(log r, ±20)) in every implementation

_F = TypeVar("_F", bound=Callable[..., Any])


def per_config(maxsize: int) -> Callable[[_F], _F]:
    """Cache ``fn(config, *args)`` per config *object* (and ``args``, hashable): configs are frozen, and a
    training step passes the same object to every call, so what a rung works out from it is worked out
    once. The one invalidation rule of the kernels' per-config caches: the key is ``id(config)``, a hit
    must hold that very object (the cache keeps a reference, so a live entry's id cannot be reused by
    another object), and past ``maxsize`` entries the cache starts afresh (a process that makes a config
    per step — ``resolve_thresholds`` under a data-chosen bound — must not grow it without bound).
    ``fn.cache_clear()`` empties it."""

    def wrap(fn: _F) -> _F:
        entries: dict[tuple, tuple[Any, Any]] = {}

        @functools.wraps(fn)
        def cached(config, *args):
            key = (id(config), *args)
            hit = entries.get(key)
            if hit is not None and hit[0] is config:
                return hit[1]
            value = fn(config, *args)
            if len(entries) >= maxsize:
                entries.clear()
            entries[key] = (config, value)
            return value

        cached.cache_clear = entries.clear
        return cached  # type: ignore[return-value]

    return wrap


def bounds_of(config: LossConfig) -> tuple[float, ...]:
    """The runtime bounds of the fast rungs, in order: (low, high) of each rejection rule, the weight's
    (low, high), 1 − ε_low, 1 + ε_high and the dual clip c; ±inf for an open bound (it never binds: a
    Triton kernel compares with it; the compiled core reads only the bounds its spec says are set).
    Which bounds are set is structure (each rung's spec); their numbers are data, so a bound that
    ``resolve_thresholds`` chooses anew every optimizer step compiles nothing anew."""
    corr = config.correction
    out: list[float] = []
    if corr is not None:
        for rule in corr.reject:
            out += [_bound(rule.low, -math.inf), _bound(rule.high, math.inf)]
    w = corr.weight if corr is not None and corr.anchor != "rollout" else None
    out += [_bound(w.low, -math.inf), _bound(w.high, math.inf)] if w is not None else [-math.inf, math.inf]
    out += [-math.inf if config.clip_low is None else 1.0 - config.clip_low,
            math.inf if config.clip_high is None else 1.0 + config.clip_high, _bound(config.dual_clip, math.inf)]
    return tuple(out)


def _bound(value: float | None, open_end: float) -> float:
    return open_end if value is None else float(value)


BOUND_VECTORS = 256  # distinct bounds vectors (per device) whose device copy a process keeps
_BOUND_TENSORS: dict[tuple[bytes, torch.device], torch.Tensor] = {}


def bounds_tensor(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """``values`` (``bounds_of``) as fp32 on ``device`` — compared as the reference compares a Python bound
    with fp32 values: in fp32 — copied there once per distinct vector: configs that differ in nothing but
    their identity (one made per call) share it, and a new data-chosen bound costs one small host→device
    copy. Keyed by the values' bits (0.0 and −0.0 are two keys); read-only, so sharing it is safe."""
    key = (struct.pack(f"{len(values)}d", *values), device)
    tensor = _BOUND_TENSORS.get(key)
    if tensor is None:
        if len(_BOUND_TENSORS) >= BOUND_VECTORS:
            _BOUND_TENSORS.clear()
        tensor = _BOUND_TENSORS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return tensor


def to_input_dtype(grad: torch.Tensor, dtype: torch.dtype, owned: bool = False) -> torch.Tensor:
    """Cast an fp32 gradient back to the input's dtype, saturating at its largest finite value:
    fp16 holds at most 65504, and a clipped PPO ratio alone reaches e^20 ≈ 5e8, so a plain cast
    would hand the optimiser ±inf (issue #9, found by the fuzz). NaN cannot arise here.

    ``owned``: ``grad`` is the caller's own temporary, clamped in place — out of place, a second fp32
    [B, T] lived beside it while it was cast (issue #44: a bf16 peak of 3.0 B·T fp32 instead of 2.0)."""
    if dtype in (torch.float16, torch.bfloat16) and grad.dtype != dtype:
        big = torch.finfo(dtype).max
        grad = grad.clamp_(-big, big) if owned else grad.clamp(-big, big)
    return grad.to(dtype)


class UpcastSaturating(torch.autograd.Function):
    """x.float() whose backward casts the gradient back with ``to_input_dtype`` (the reference's
    entry point for π_θ)."""

    @staticmethod
    def forward(ctx, x):
        ctx.dtype = x.dtype
        return x.float()

    @staticmethod
    def backward(ctx, grad):
        return to_input_dtype(grad, ctx.dtype)


class CoefLoss(torch.autograd.Function):
    """forward(logprobs, loss_value, coef, scale) → loss_value; backward: grad · coef · scale."""

    @staticmethod
    def forward(ctx, logprobs, loss_value, coef, scale):  # noqa: D401
        ctx.save_for_backward(coef, scale)
        ctx.dtype = logprobs.dtype
        return loss_value.clone()

    @staticmethod
    def backward(ctx, grad):
        coef, scale = ctx.saved_tensors
        # grad·scale is [B, 1] (or a scalar): one [B, T] product, no [B, T] temporary
        grad = coef * (grad * scale)
        return (grad if ctx.dtype == torch.float32 else to_input_dtype(grad, ctx.dtype, owned=True)), None, None, None


class CoefTokens(torch.autograd.Function):
    """forward(logprobs, per_token, coef) → per_token; backward: grad ⊙ coef (for reduce=False)."""

    @staticmethod
    def forward(ctx, logprobs, per_token, coef):
        ctx.save_for_backward(coef)
        ctx.dtype = logprobs.dtype
        return per_token.clone()

    @staticmethod
    def backward(ctx, grad):
        (coef,) = ctx.saved_tensors
        grad = grad * coef
        return (grad if ctx.dtype == torch.float32 else to_input_dtype(grad, ctx.dtype, owned=True)), None, None


def row_aggregation(row_sum, row_count, cfg: LossConfig, width: int):
    """From per-row loss sums and denominator counts ``[B]``: (numerator, count, row_scale) with
    loss = numerator / max(count, 1) and ∂loss/∂ℓ_bt = row_scale_b / max(count, 1)."""
    if cfg.agg == "token-mean":
        count = cfg.global_tokens if cfg.global_tokens is not None else row_count.sum()
        row_scale = torch.ones_like(row_count)
    else:
        count = cfg.global_seqs if cfg.global_seqs is not None else (row_count > 0).sum()
        if cfg.agg == "seq-mean-token-mean":
            row_scale = 1.0 / row_count.clamp(min=1)
        elif cfg.agg == "seq-mean-token-sum":
            row_scale = torch.ones_like(row_count)
        else:
            row_scale = torch.full_like(row_count, 1.0 / float(cfg.max_len or width))
    count = torch.as_tensor(count, dtype=row_sum.dtype, device=row_sum.device)
    return (row_sum * row_scale).sum(), count, row_scale

