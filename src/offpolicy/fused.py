"""Fast path: ``correct`` + ``policy_loss`` in a few fused passes with an analytic backward.

Same results as the readable path (``correction.py`` + ``losses.py``, the oracle), less time
and memory. One ``torch.autograd.Function`` computes, without building an autograd graph of
intermediates:

* the per-token loss ℓ_t and its derivative c_t = ∂ℓ_t/∂log π_θ(y_t) (saved: one [B, T] fp32
  tensor — the only activation kept for backward);
* every metric's partial sums, gathered into one vector (one device sync in ``to_dict``).

Derivatives (r = π_θ/π_old, w the detached IS weight, s the clipped ratio):
    ppo       ℓ = −A·s·w, s = min(r, 1+ε_h) for A > 0, max(r, 1−ε_l) for A < 0
              c = −A·r·w where s = r (clip inactive) and, with a dual clip, ℓ > −c·A did not bind
    cispo     ℓ = −sg(clip(r))·A·w·log π_θ,   c = −clip(r)·A·w
    reinforce ℓ = −A·w·log π_θ,               c = −A·w
and the backward is grad · c_t · (∂L/∂ℓ_t), the last factor being 1/N (token-mean) or
1/(N_rows·n_b), 1/N_rows, 1/(N_rows·max_len) for the sequence aggregations.

Used automatically by ``policy_loss`` when ``supports(config)`` holds (ppo / cispo /
reinforce losses without a KL term; every weighting, rejection rule, anchor and aggregation).
Inputs with NaN/inf anywhere (even in padding) are handed to the readable path, which applies
the ``nonfinite`` policy — so the fast path never changes what happens to bad data.
"""

from __future__ import annotations

import torch

import functools
import logging
import math
import os
from typing import NamedTuple

from offpolicy import ops
from offpolicy.config import CorrectionConfig, LossConfig, rule_name
from offpolicy.metrics import Metrics

log = logging.getLogger(__name__)

_RATIO_LOG_CLAMP = 20.0
FUSED_KINDS = ("ppo", "cispo", "reinforce")


def supports(config: LossConfig, ref_logprobs: torch.Tensor | None) -> bool:
    """Whether the fast path computes exactly what the readable path would."""
    return config.kind in FUSED_KINDS and ref_logprobs is None


class _FusedLoss(torch.autograd.Function):
    """forward(logprobs, coef, scale) → Σ ℓ·scale; backward: grad · coef · scale."""

    @staticmethod
    def forward(ctx, logprobs, loss_value, coef, scale):  # noqa: D401
        ctx.save_for_backward(coef, scale)
        ctx.dtype = logprobs.dtype
        return loss_value.clone()

    @staticmethod
    def backward(ctx, grad):
        coef, scale = ctx.saved_tensors
        # grad·scale is [B, 1] (or a scalar): one [B, T] product, no [B, T] temporary
        return (coef * (grad * scale)).to(ctx.dtype), None, None, None


class _FusedTokens(torch.autograd.Function):
    """forward(logprobs, per_token, coef) → per_token; backward: grad ⊙ coef (for reduce=False)."""

    @staticmethod
    def forward(ctx, logprobs, per_token, coef):
        ctx.save_for_backward(coef)
        ctx.dtype = logprobs.dtype
        return per_token.clone()

    @staticmethod
    def backward(ctx, grad):
        (coef,) = ctx.saved_tensors
        return (grad * coef).to(ctx.dtype), None, None


def _weights(cfg: CorrectionConfig, log_ratio, ratio, m, keep, metrics: Metrics):
    """IS weights on the surviving mask (float ``m``), same semantics as ``correction.compute_weights``."""
    from offpolicy.correction import _weight_fn, normalize_weights

    w_cfg = cfg.weight
    if w_cfg.level == "token":
        weights = _weight_fn(w_cfg, ratio)
        unit, unit_mask = ratio, keep
    else:
        row = ops.row_log_ratio(log_ratio, keep, geometric=w_cfg.level == "geometric")
        unit = ops.safe_exp(row, ops.effective_log_clamp(cfg.log_clamp))
        unit_mask = keep.any(dim=-1)
        weights = _weight_fn(w_cfg, unit).unsqueeze(-1)
    above = (unit > w_cfg.high) if w_cfg.high is not None else torch.zeros_like(unit_mask)
    below = (unit < w_cfg.low) if w_cfg.low is not None else torch.zeros_like(unit_mask)
    n_units = unit_mask.sum()
    metrics.ratio("fraction_above_high", (above & unit_mask).sum(), n_units)
    metrics.ratio("fraction_below_low", (below & unit_mask).sum(), n_units)
    weights = weights * m  # [B, T] (broadcast rows), 0 off the surviving mask
    if w_cfg.normalize:
        weights = normalize_weights(weights, keep, w_cfg.level)
    return weights


def fused_policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config: LossConfig, reduce: bool):
    """The fast path of ``policy_loss``; returns None when the inputs need the readable path."""
    from offpolicy.correction import _Batch, apply_rejection, trainer_side, validate_inputs

    corr = config.correction
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs,
               "advantages": advantages}
    if mask.dim() != 2 or any(t is not None and (t.shape != mask.shape or not t.is_floating_point())
                              for t in tensors.values()):
        validate_inputs(mask, **tensors)  # raises the precise message
    with torch.no_grad():
        lp = logprobs.detach().float()
        adv = advantages.float()
        m = mask if mask.dtype == torch.float32 else mask.float()
        input_mask = mask if mask.dtype == torch.bool else mask != 0
        n_tokens = m.sum()
        # cheap checks (two reductions); the readable validator explains any failure
        lo_hi = torch.aminmax(m)
        if mask.dtype != torch.bool and (lo_hi.min < 0 or lo_hi.max > 1 or (m * m).sum() != n_tokens) or n_tokens == 0:
            validate_inputs(mask, **tensors)
        metrics = Metrics()

        # ---------------------------------------------------------------- correction
        if corr is not None:
            anchor = corr.anchor
            _, trainer = trainer_side(anchor, None if anchor == "rollout" else old_logprobs, lp)
            trainer = trainer.float()
            rollout = rollout_logprobs.float()
            old = rollout if anchor == "rollout" else (None if old_logprobs is None else old_logprobs.float())
            clamp = ops.effective_log_clamp(corr.log_clamp)
            log_ratio = (trainer - rollout).clamp_(-clamp, clamp)  # [B, T]; finite garbage off the mask
            ratio = torch.exp(log_ratio)
            em1 = torch.expm1(log_ratio)  # ρ − 1, exact near ρ = 1 where sums of ρ − 1 would cancel
            trainer_m, rollout_m, lp_m = trainer * m, rollout * m, lp * m
            old_m = old * m if old is not None and anchor == "current" else torch.zeros(())
            # a NaN/±inf anywhere (even in padding: inf·0 = NaN) makes a sum non-finite: then the
            # readable path applies the nonfinite policy
            sums = torch.stack([trainer_m.sum(), rollout_m.sum(), lp_m.sum(), (adv * m).sum(), old_m.sum()])
            if not bool(torch.isfinite(sums).all()):
                return None
            maxima = torch.stack([trainer_m.amax(), rollout_m.amax(), lp_m.amax(), old_m.amax()])
            if bool((maxima > 1e-6).any()):
                validate_inputs(mask, **tensors)  # a positive log-prob: raises naming the tensor
            _mismatch_metrics(metrics, trainer_m, rollout_m, log_ratio, ratio, em1, m, input_mask, n_tokens, clamp)
            if corr.reject:
                zero = torch.zeros((), device=m.device)
                batch = _Batch(log_ratio=torch.where(input_mask, log_ratio, zero), trainer=trainer_m,
                               rollout=rollout_m, current=lp_m, advantages=adv * m, clamp=clamp)
                keep = apply_rejection(corr, batch, input_mask, input_mask, metrics)
                km = keep.float()
            else:
                keep, km = input_mask, m
            metrics.ratio("masked_fraction", n_tokens - km.sum(), n_tokens)
            rows_in = input_mask.any(-1)
            metrics.ratio("masked_fraction_seq", (input_mask & ~keep).any(-1).sum(), rows_in.sum())
            if corr.weight is not None and anchor != "rollout":
                weights = _weights(corr, log_ratio, ratio, km, keep, metrics)
            else:
                weights = km
            _weight_metrics(metrics, weights, keep, km)
            denominator_mask = m if corr.denominator == "fixed" else km
        else:
            old = None if old_logprobs is None else old_logprobs.float()
            keep, km, weights, denominator_mask = input_mask, m, m, m
            lp_m = lp * m
            old_m = old * m if old is not None else torch.zeros(())
            if not bool(torch.isfinite(torch.stack([lp_m.sum(), (adv * m).sum(), old_m.sum()])).all()):
                return None
            if bool((torch.stack([lp_m.amax(), old_m.amax()]) > 1e-6).any()):
                validate_inputs(mask, **tensors)
        if old is None and config.kind != "reinforce":
            return None  # the readable path raises the explanatory error

        # ---------------------------------------------------------------- loss and its derivative
        adv_w = adv * weights  # A·w, 0 off the surviving mask
        if old is not None:
            log_r = (lp - old).clamp_(-_RATIO_LOG_CLAMP, _RATIO_LOG_CLAMP)
            metrics.ratio("approx_kl", ((torch.expm1(log_r) - log_r) * km).sum(), km.sum())  # k3 of π_θ vs π_old
        if config.kind == "reinforce":
            per_token = -adv_w * lp
            coef = -adv_w
        else:
            r = torch.exp(log_r)
            lo = None if config.clip_low is None else 1.0 - config.clip_low
            hi = None if config.clip_high is None else 1.0 + config.clip_high
            if config.kind == "cispo":
                kept = r.clamp(min=lo, max=hi) if (lo is not None or hi is not None) else r
                per_token = -kept * adv_w * lp
                coef = -kept * adv_w
                metrics.ratio("clip_fraction", ((kept != r) & keep).sum(), km.sum())
            else:  # ppo
                # max(−A·r, −A·clip(r)) = −A·min(r, 1+ε_h) for A > 0 and −A·max(r, 1−ε_l) for A < 0
                clipped = torch.where(adv > 0, r.clamp(max=hi) if hi is not None else r,
                                      r.clamp(min=lo) if lo is not None else r)
                per_token = -adv_w * clipped
                active = clipped == r  # gradient flows only through the unclipped branch
                metrics.ratio("clip_fraction", (~active & (adv != 0) & keep).sum(), km.sum())
                if config.dual_clip is not None:
                    dual = (adv < 0) & (clipped > config.dual_clip)  # −A·s > −c·A ⇔ s > c for A < 0
                    metrics.ratio("dual_clip_fraction", (dual & keep).sum(), km.sum())
                    per_token = torch.where(dual, -adv_w * config.dual_clip, per_token)
                    active = active & ~dual
                coef = torch.where(active, -adv_w * r, torch.zeros((), device=r.device))

        # ---------------------------------------------------------------- aggregation
        scale, numerator, count = _aggregate(per_token, denominator_mask, config)
        if config.global_tokens is not None or config.global_seqs is not None:
            metrics.sum("loss", numerator / count.clamp(min=1))
        else:
            metrics.ratio("loss", numerator, count)

    if not reduce:
        return _FusedTokens.apply(logprobs, per_token, coef), denominator_mask.clone(), metrics
    loss_value = numerator / count.clamp(min=1)
    return _FusedLoss.apply(logprobs, loss_value, coef, scale), metrics


def _aggregate(per_token, mask, cfg: LossConfig):
    """(∂L/∂ℓ_t as a broadcastable tensor, Σ contributions, count) for each aggregation."""
    numerator, count, row_scale = row_aggregation(per_token.sum(-1), mask.sum(-1), cfg, per_token.shape[-1])
    return (row_scale / count.clamp(min=1)).unsqueeze(-1), numerator, count


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


def _mismatch_metrics(metrics, trainer_m, rollout_m, log_ratio, ratio, em1, m, valid, n, clamp):
    """The SPEC §7 mismatch block (same values as ``correction.mismatch_metrics``), sharing passes."""
    lr_m = log_ratio * m
    row_lr = lr_m.sum(-1)  # [B] Σ_t log ρ_t (clamped per token)
    em1_m = em1 * m
    metrics.ratio("kl_k1", -row_lr.sum(), n)
    metrics.ratio("kl_k3", (em1_m - lr_m).sum(), n)  # Σ (ρ − 1 − log ρ)
    # ρ² overflows fp32 beyond log ρ = 44, reachable only with log_clamp > 44 (or None)
    if clamp > 44:
        em1_m, em1, ratio = em1_m.double(), em1.double(), ratio.double()
    metrics.ratio("chi2_token", (em1_m * (em1 + 2.0)).sum(), n)  # Σ (ρ² − 1), no cancellation near ρ = 1
    rho_m = ratio * m
    # ESS is a ratio of sums of ρ and ρ²: no cancellation, so the plain sums are exact enough
    metrics._put("ess", "ess", torch.stack([rho_m.sum().double(), (rho_m * ratio).sum().double(), n.double()]))
    rows = valid.any(-1)
    rows_f = rows.float()
    n_rows = rows.sum()
    row_n = m.sum(-1).clamp(min=1)
    mean_train = trainer_m.sum(-1) / row_n
    mean_rollout = rollout_m.sum(-1) / row_n
    seq = row_lr.double().clamp(-clamp, clamp)
    metrics.ratio("chi2_seq", (torch.expm1(2.0 * seq) * rows_f).sum(), n_rows)
    metrics.ratio("ppl_train", (ops.safe_exp(-mean_train, None) * rows_f).sum(), n_rows)
    metrics.ratio("ppl_rollout", (ops.safe_exp(-mean_rollout, None) * rows_f).sum(), n_rows)
    diff = (rollout_m - trainer_m).sum(-1) / row_n  # per-token differences: no cancellation
    metrics.ratio("log_ppl_diff", (diff * rows_f).sum(), n_rows)
    metrics.ratio("ppl_ratio", (ops.safe_exp(diff, None) * rows_f).sum(), n_rows)
    abs_lr = lr_m.abs_()  # 0 off the mask and ≥ 0: its max is the max over the mask
    metrics.ratio("abs_logp_diff_mean", abs_lr.sum(), n)
    metrics._put("abs_logp_diff_max", "max", torch.stack([abs_lr.amax(), n]).double())
    prob_diff = (torch.exp(trainer_m) - torch.exp(rollout_m)).abs_()  # exp(0) − exp(0) = 0 off the mask
    metrics.ratio("prob_diff_mean", prob_diff.sum(), n)
    metrics._put("prob_diff_max", "max", torch.stack([prob_diff.amax(), n]).double())
    metrics.sum("nonfinite_tokens", 0.0)
    metrics.sum("valid_tokens", n)


def _weight_metrics(metrics, weights, keep, km):
    n = km.sum().double()
    # the std reducer's E[w²] − E[w]² cancels for weights near 1: square in fp64, as the readable path does
    w64 = weights.double()
    w_sum, w2_sum = w64.sum(), (w64 * w64).sum()
    metrics.ratio("is_mean", w_sum, n)
    metrics._put("is_std", "std", torch.stack([w_sum, w2_sum, n]).double())
    metrics._put("is_ess", "ess", torch.stack([w_sum, w2_sum, n]).double())
    inf = torch.full((), float("inf"), device=weights.device)
    metrics._put("is_min", "min", torch.stack([torch.where(keep, weights, inf).amin(), n]).double())
    metrics._put("is_max", "max", torch.stack([torch.where(keep, weights, -inf).amax(), n]).double())


# =================================================================================== compiled core
# The eager fast path above still makes ~80 passes over [B, T] memory. For the common
# configurations the whole forward — ratios, rules, weights, loss, derivative and every metric's
# partial sum — is one pure tensor function, which torch.compile (inductor: C++/OpenMP on CPU,
# Triton on GPU) fuses into a handful of loops. Sums accumulate in fp64 inside those loops.


class CoreSpec(NamedTuple):
    """The Python constants the compiled core specialises on (one compile per distinct spec)."""

    corrected: bool
    anchor: str
    log_clamp: float
    rules: tuple[tuple[str, float | None, float | None], ...]  # ratio rules: (level, low, high)
    sequential: bool
    weight: tuple[str, str, float | None, float | None] | None  # (level, mode, low, high)
    fixed_denominator: bool
    kind: str
    clip_low: float | None
    clip_high: float | None
    dual_clip: float | None
    has_old: bool
    unreduced: bool


def core_spec(config: LossConfig, has_old: bool, reduce: bool) -> CoreSpec | None:
    """The spec of ``config``, or None when the compiled core does not cover it."""
    corr = config.correction
    if corr is None:
        return CoreSpec(False, "old", 20.0, (), False, None, False, config.kind, config.clip_low, config.clip_high,
                        config.dual_clip, has_old, not reduce)
    if any(getattr(r, "stat", None) != "ratio" for r in corr.reject):
        return None
    if corr.weight is not None and corr.weight.normalize:
        return None
    weight = None
    if corr.weight is not None and corr.anchor != "rollout":
        weight = (corr.weight.level, corr.weight.mode, corr.weight.low, corr.weight.high)
    rules = tuple((r.level, r.low, r.high) for r in corr.reject)
    return CoreSpec(True, corr.anchor, ops.effective_log_clamp(corr.log_clamp), rules,
                    corr.reject_mode == "sequential", weight, corr.denominator == "fixed", config.kind,
                    config.clip_low, config.clip_high, config.dual_clip, has_old or corr.anchor == "rollout",
                    not reduce)


def _band(x, low, high):
    keep = torch.ones_like(x, dtype=torch.bool)
    if low is not None:
        keep = keep & (x >= low)
    if high is not None:
        keep = keep & (x <= high)
    return keep


def _f(mode, low, high, x):
    if mode == "truncate":
        return x if low is None and high is None else x.clamp(min=low, max=high)
    return x * _band(x, low, high)


def _core(lp, old, roll, adv, m, spec: CoreSpec):
    """Everything of the fast path that touches [B, T] memory; returns tensors only."""
    f64 = torch.float64
    valid = m > 0
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    out = {}
    scalars = {"n": m.sum(dtype=f64), "lp_sum": (lp * m).sum(dtype=f64), "adv_sum": (adv * m).sum(dtype=f64)}
    maxima = {"lp_max": (lp * m).amax()}
    keep, km = valid, m
    if spec.corrected:
        trainer = old if spec.anchor == "old" else lp
        L = spec.log_clamp
        lr = (trainer - roll).clamp(-L, L)
        ratio, em1 = torch.exp(lr), torch.expm1(lr)
        lr_m, em1_m = lr * m, em1 * m
        tm, rm = trainer * m, roll * m
        scalars.update(
            trainer_sum=tm.sum(dtype=f64), rollout_sum=rm.sum(dtype=f64),
            kl_k1=-lr_m.sum(dtype=f64), kl_k3=(em1_m - lr_m).sum(dtype=f64),
            chi2=(em1_m.double() * (em1.double() + 2.0)).sum(), rho=(ratio * m).sum(dtype=f64),
            rho2=(ratio.double() * ratio.double() * m.double()).sum(), abs_lr=lr_m.abs().sum(dtype=f64),
            prob_diff=(torch.exp(tm) - torch.exp(rm)).abs().sum(dtype=f64),
        )
        maxima.update(trainer_max=tm.amax(), rollout_max=rm.amax(), abs_lr_max=lr_m.abs().amax(),
                      prob_diff_max=(torch.exp(tm) - torch.exp(rm)).abs().amax())
        out["rows"] = torch.stack([tm.sum(-1, dtype=f64), rm.sum(-1, dtype=f64), lr_m.sum(-1, dtype=f64),
                                   m.sum(-1, dtype=f64)])
        removed = []
        for level, low, high in spec.rules:
            seen = keep if spec.sequential else valid
            seen_f = seen.to(lr.dtype)
            if level == "token":
                ok = _band(ratio, low, high)
            elif level == "any_token":
                ok = (~((~_band(ratio, low, high)) & seen).any(-1)).unsqueeze(-1)
            else:
                row = (lr * seen_f).sum(-1)
                if level == "geometric":
                    row = row / seen_f.sum(-1).clamp(min=1)
                ok = _band(torch.exp(row.clamp(-L, L)), low, high).unsqueeze(-1)
            new = seen & ok
            removed.append((seen & ~new).sum(-1, dtype=f64))
            keep = keep & new
        out["removed"] = torch.stack(removed) if removed else None
        km = keep.to(lp.dtype)
        if spec.weight is not None:
            level, mode, low, high = spec.weight
            if level == "token":
                w = _f(mode, low, high, ratio) * km
                unit, unit_mask = ratio, keep
            else:
                row = (lr * km).sum(-1)
                if level == "geometric":
                    row = row / km.sum(-1).clamp(min=1)
                unit = torch.exp(row.clamp(-L, L))
                unit_mask = km.sum(-1) > 0
                w = _f(mode, low, high, unit).unsqueeze(-1) * km
            scalars["above"] = ((unit > high) & unit_mask).sum(dtype=f64) if high is not None else zero.double()
            scalars["below"] = ((unit < low) & unit_mask).sum(dtype=f64) if low is not None else zero.double()
            scalars["units"] = unit_mask.sum(dtype=f64)
        else:
            w = km
        w64 = w.double()
        scalars.update(w_sum=w64.sum(), w2_sum=(w64 * w64).sum(), n_keep=km.sum(dtype=f64))
        maxima.update(w_max=torch.where(keep, w, -torch.inf).amax(), w_min_neg=-torch.where(keep, w, torch.inf).amin())
    else:
        w = m
    if spec.has_old:
        maxima["old_max"] = (old * m).amax()
        scalars["old_sum"] = (old * m).sum(dtype=f64)
        log_r = (lp - old).clamp(-20.0, 20.0)
        r = torch.exp(log_r)
        scalars["approx_kl"] = ((torch.expm1(log_r) - log_r) * km).sum(dtype=f64)
    adv_w = adv * w
    if spec.kind == "reinforce":
        per_token, coef = -adv_w * lp, -adv_w
    elif spec.kind == "cispo":
        lo = None if spec.clip_low is None else 1.0 - spec.clip_low
        hi = None if spec.clip_high is None else 1.0 + spec.clip_high
        kept = r if lo is None and hi is None else r.clamp(min=lo, max=hi)
        per_token, coef = -kept * adv_w * lp, -kept * adv_w
        scalars["clip"] = ((kept != r) & keep).sum(dtype=f64)
    else:
        lo = None if spec.clip_low is None else 1.0 - spec.clip_low
        hi = None if spec.clip_high is None else 1.0 + spec.clip_high
        clipped = torch.where(adv > 0, r if hi is None else r.clamp(max=hi), r if lo is None else r.clamp(min=lo))
        per_token = -adv_w * clipped
        active = clipped == r
        scalars["clip"] = ((~active) & (adv != 0) & keep).sum(dtype=f64)
        if spec.dual_clip is not None:
            dual = (adv < 0) & (clipped > spec.dual_clip)
            scalars["dual"] = (dual & keep).sum(dtype=f64)
            per_token = torch.where(dual, -adv_w * spec.dual_clip, per_token)
            active = active & ~dual
        coef = torch.where(active, -adv_w * r, zero)
    den = m if (spec.fixed_denominator or not spec.corrected) else km
    out["loss_rows"] = torch.stack([per_token.sum(-1, dtype=f64), den.sum(-1, dtype=f64), km.sum(-1, dtype=f64)])
    scalars.update(m2=(m * m).sum(dtype=f64))
    maxima.update(m_max=m.amax(), m_min_neg=-m.amin())
    out["coef"] = coef
    out["per_token"] = per_token if spec.unreduced else None
    out["den"] = den if spec.unreduced else None
    names_s, names_m = sorted(scalars), sorted(maxima)
    out["scalars"] = torch.stack([scalars[k] for k in names_s])
    out["maxima"] = torch.stack([maxima[k] for k in names_m])
    return out, names_s, names_m


_compile_failed = False
COMPILE_MIN_TOKENS = 1 << 16


def _use_compiled(numel: int) -> bool:
    """OFFPOLICY_COMPILE: "1" always, "0" never, "auto" (default) for batches of ≥ 65,536 tokens,
    where the one-off compile (~10–20 s per configuration) pays for itself within a few steps."""
    setting = os.environ.get("OFFPOLICY_COMPILE", "auto")
    if _compile_failed or setting == "0":
        return False
    return setting == "1" or numel >= COMPILE_MIN_TOKENS


@functools.lru_cache(maxsize=64)
def _compiled(spec: CoreSpec):
    # dynamic shapes: one compile serves every [B, T]; dynamic_threads keeps the CPU kernel
    # OpenMP-parallel under dynamic shapes (without it inductor emits a serial loop: 10.9 vs 6.7 ms
    # at 256×4096 on 2 cores)
    return torch.compile(functools.partial(_core, spec=spec), dynamic=True, options={"cpp.dynamic_threads": True})


def compiled_policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config: LossConfig, reduce: bool):
    """The compiled fast path; None when it does not apply or the readable path must handle the inputs."""
    global _compile_failed
    from offpolicy.correction import validate_inputs

    corr = config.correction
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs,
               "advantages": advantages}
    if mask.dim() != 2 or any(t is not None and (t.shape != mask.shape or not t.is_floating_point())
                              for t in tensors.values()):
        validate_inputs(mask, **tensors)
    spec = core_spec(config, old_logprobs is not None, reduce)
    if spec is None or (spec.kind != "reinforce" and not spec.has_old):
        return None
    f32 = torch.float32
    lp = logprobs.detach().to(f32)
    roll = rollout_logprobs.to(f32) if rollout_logprobs is not None else lp
    if corr is not None and corr.anchor == "rollout":
        old = roll
    else:
        old = old_logprobs.to(f32) if old_logprobs is not None else lp
    adv, m = advantages.to(f32), mask.to(f32)
    try:
        with torch.no_grad():
            out, names_s, names_m = _compiled(spec)(lp, old, roll, adv, m)
    except Exception as err:  # noqa: BLE001 — no compiler, unsupported backend: stay correct, go eager
        _compile_failed = True
        log.warning("offpolicy: torch.compile of the fused loss failed (%s); using the eager fast path", err)
        return None
    S = dict(zip(names_s, out["scalars"].tolist()))
    M = dict(zip(names_m, out["maxima"].tolist()))
    if not all(math.isfinite(v) for v in S.values()):
        return None  # NaN/inf somewhere: the readable path applies the nonfinite policy
    n = S["n"]
    binary = mask.dtype == torch.bool or (S["m2"] == n and M["m_max"] <= 1 and M["m_min_neg"] <= 0)
    positive = any(M[k] > 1e-6 for k in ("lp_max", "old_max", "trainer_max", "rollout_max") if k in M)
    if not binary or n == 0 or positive:
        validate_inputs(mask, **tensors)  # raises the readable path's message
    metrics = Metrics()
    loss_rows = out["loss_rows"]
    n_keep = S.get("n_keep", n)
    if spec.corrected:
        _assemble_correction_metrics(metrics, corr, spec, S, M, out, n, n_keep, loss_rows[2])
    if "clip" in S:
        metrics.ratio("clip_fraction", S["clip"], n_keep)
    if "dual" in S:
        metrics.ratio("dual_clip_fraction", S["dual"], n_keep)
    if "approx_kl" in S:
        metrics.ratio("approx_kl", S["approx_kl"], n_keep)
    numerator, count, row_scale = row_aggregation(loss_rows[0], loss_rows[1], config, mask.shape[-1])
    if config.global_tokens is not None or config.global_seqs is not None:
        metrics.sum("loss", numerator / count.clamp(min=1))
    else:
        metrics.ratio("loss", numerator, count)
    scale = (row_scale / count.clamp(min=1)).to(f32).unsqueeze(-1)
    if not reduce:
        return _FusedTokens.apply(logprobs, out["per_token"], out["coef"]), out["den"].clone(), metrics
    loss_value = (numerator / count.clamp(min=1)).to(f32)
    return _FusedLoss.apply(logprobs, loss_value, out["coef"], scale), metrics


def _assemble_correction_metrics(metrics, corr, spec, S, M, out, n, n_keep, keep_rows):
    """The same keys, reducers and values as ``correct`` records, from the core's partial sums."""
    metrics.sum("nonfinite_tokens", 0.0)
    metrics.sum("valid_tokens", n)
    metrics.ratio("kl_k1", S["kl_k1"], n)
    metrics.ratio("kl_k3", S["kl_k3"], n)
    metrics.ratio("chi2_token", S["chi2"], n)
    metrics._put("ess", "ess", torch.tensor([S["rho"], S["rho2"], n], dtype=torch.float64))
    trainer_rows, rollout_rows, lr_rows, counts = out["rows"]
    rows = counts > 0
    n_rows = rows.sum()
    safe = counts.clamp(min=1)
    mean_train, mean_rollout = trainer_rows / safe, rollout_rows / safe
    seq = lr_rows.clamp(-spec.log_clamp, spec.log_clamp)
    metrics.ratio("chi2_seq", torch.where(rows, torch.expm1(2.0 * seq), 0.0).sum(), n_rows)
    cap = ops.FP32_EXP_LIMIT
    metrics.ratio("ppl_train", torch.where(rows, torch.exp((-mean_train).clamp(-cap, cap)), 0.0).sum(), n_rows)
    metrics.ratio("ppl_rollout", torch.where(rows, torch.exp((-mean_rollout).clamp(-cap, cap)), 0.0).sum(), n_rows)
    diff = mean_rollout - mean_train
    metrics.ratio("log_ppl_diff", torch.where(rows, diff, 0.0).sum(), n_rows)
    metrics.ratio("ppl_ratio", torch.where(rows, torch.exp(diff.clamp(-cap, cap)), 0.0).sum(), n_rows)
    metrics.ratio("abs_logp_diff_mean", S["abs_lr"], n)
    metrics._put("abs_logp_diff_max", "max", torch.tensor([M["abs_lr_max"], n], dtype=torch.float64))
    metrics.ratio("prob_diff_mean", S["prob_diff"], n)
    metrics._put("prob_diff_max", "max", torch.tensor([M["prob_diff_max"], n], dtype=torch.float64))
    if out["removed"] is not None:
        for i, rule in enumerate(corr.reject):
            removed = out["removed"][i]
            name = f"reject/{rule_name(i, rule)}"
            metrics.ratio(f"{name}/masked_fraction", removed.sum(), n)
            metrics.ratio(f"{name}/masked_fraction_seq", (removed > 0).sum(), n_rows)
    metrics.ratio("masked_fraction", n - n_keep, n)
    metrics.ratio("masked_fraction_seq", ((counts - keep_rows) > 0).sum(), n_rows)
    if spec.weight is not None:
        metrics.ratio("fraction_above_high", S["above"], S["units"])
        metrics.ratio("fraction_below_low", S["below"], S["units"])
    metrics.ratio("is_mean", S["w_sum"], n_keep)
    moments = torch.tensor([S["w_sum"], S["w2_sum"], n_keep], dtype=torch.float64)
    metrics._put("is_std", "std", moments)
    metrics._put("is_ess", "ess", moments.clone())
    metrics._put("is_min", "min", torch.tensor([-M["w_min_neg"], n_keep], dtype=torch.float64))
    metrics._put("is_max", "max", torch.tensor([M["w_max"], n_keep], dtype=torch.float64))
