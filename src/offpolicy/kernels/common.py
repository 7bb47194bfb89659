"""What several implementations share: the autograd Functions of the analytic backward and
the row aggregation with its derivative.

A fast implementation computes, without an autograd graph, the per-token loss ℓ_t and its
derivative c_t = ∂ℓ_t/∂log π_θ(y_t); ``CoefLoss``/``CoefTokens`` attach that derivative to
π_θ so that ``backward`` is one [B, T] product: grad · c_t · ∂L/∂ℓ_t.
"""

from __future__ import annotations

import torch

from offpolicy.config import LossConfig

RATIO_LOG_CLAMP = 20.0  # PPO's own ratio π_θ/π_old: exp(clamp(log r, ±20)) in every implementation


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


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]  # what Function.apply ends in


def attach(function: type[torch.autograd.Function], logprobs: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
    """``function.apply(logprobs, *args)`` without the Python wrapper's per-call work where it has
    none to do (issue #44: ~3–5 µs of a loss call's host time): outside functorch transforms and
    torch.compile's tracing, ``Function.apply`` only unwraps a dead functorch wrapper — only
    ``logprobs`` can be one, the other arguments are the rung's own fresh tensors — and calls this."""
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return function.apply(logprobs, *args)
    return _C_APPLY.__get__(None, function)(torch._C._functorch.unwrap_if_dead(logprobs), *args)


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

