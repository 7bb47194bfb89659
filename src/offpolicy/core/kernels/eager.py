"""Eager fast path: ``correct`` + ``policy_loss`` in a few fused passes with an analytic backward.

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

from offpolicy.core import ops
from offpolicy.core.config import CorrectionConfig, LossConfig
from offpolicy.core.correction import (
    RuleInputs,
    apply_rejection,
    normalize_weights,
    trainer_side,
    validate_inputs,
    weight_fn,
)
from offpolicy.core.kernels.common import RATIO_LOG_CLAMP, CoefLoss, CoefTokens, row_aggregation
from offpolicy.core.metrics import Metrics

NAME = "eager"
KINDS = ("ppo", "cispo", "reinforce")


def supports(config: LossConfig, ref_logprobs: torch.Tensor | None) -> bool:
    """Whether this path computes exactly what the reference would: kinds ppo / cispo /
    reinforce without a KL term, score centering or a ratio value cap, and no segment-level or data-chosen (ess / quantile) weight
    bound, no count after the first n rules (an integer ``denominator``); those go to the
    reference; data-chosen rejection bounds and m2 are covered."""
    corr = config.correction
    w = None if corr is None else corr.weight
    plain_weight = w is None or (w.level != "segment" and not w.adaptive)
    named_count = corr is None or isinstance(corr.denominator, str)
    return (config.kind in KINDS and ref_logprobs is None and plain_weight and named_count
            and config.score_centering is None and config.ratio_value_cap is None)


def preferred(mask: torch.Tensor) -> bool:
    """``auto`` takes the eager path wherever it applies."""
    return True


def _weights(cfg: CorrectionConfig, log_ratio, ratio, m, keep, metrics: Metrics):
    """IS weights on the surviving mask (float ``m``), same semantics as ``correction.compute_weights``."""
    w_cfg = cfg.weight
    if w_cfg.level == "token":
        weights = weight_fn(w_cfg, ratio)
        unit, unit_mask = ratio, keep
    else:
        row = ops.row_log_ratio(log_ratio, keep, geometric=w_cfg.level == "geometric")
        unit = ops.safe_exp(row, ops.effective_log_clamp(cfg.log_clamp))
        unit_mask = keep.any(dim=-1)
        weights = weight_fn(w_cfg, unit).unsqueeze(-1)
    above = (unit > w_cfg.high) if w_cfg.high is not None else torch.zeros_like(unit_mask)
    below = (unit < w_cfg.low) if w_cfg.low is not None else torch.zeros_like(unit_mask)
    n_units = unit_mask.sum()
    metrics.ratio("fraction_above_high", (above & unit_mask).sum(), n_units)
    metrics.ratio("fraction_below_low", (below & unit_mask).sum(), n_units)
    weights = weights * m  # [B, T] (broadcast rows), 0 off the surviving mask
    if w_cfg.normalize:
        weights = normalize_weights(weights, keep, w_cfg.level, w_cfg.normalize_mean)
    return weights


def policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config: LossConfig, reduce: bool,
                ref_logprobs: torch.Tensor | None = None):
    """The fast path of ``policy_loss``; returns None when the inputs need the readable path."""
    corr = config.correction
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs,
               "advantages": advantages}
    # an empty batch ([2, 0], [0, T]) has no valid token; aminmax below has no identity for it
    if mask.dim() != 2 or mask.numel() == 0 or any(
            t is not None and (t.shape != mask.shape or not t.is_floating_point()) for t in tensors.values()):
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
            old_m = old * m if old is not None and anchor == "current" else torch.zeros((), device=m.device)
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
                batch = RuleInputs(log_ratio=torch.where(input_mask, log_ratio, zero), trainer=trainer_m,
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
            old_m = old * m if old is not None else torch.zeros((), device=m.device)
            if not bool(torch.isfinite(torch.stack([lp_m.sum(), (adv * m).sum(), old_m.sum()])).all()):
                return None
            if bool((torch.stack([lp_m.amax(), old_m.amax()]) > 1e-6).any()):
                validate_inputs(mask, **tensors)
        if old is None and config.kind != "reinforce":
            return None  # the readable path raises the explanatory error

        # ---------------------------------------------------------------- loss and its derivative
        adv_w = adv * weights  # A·w, 0 off the surviving mask
        if old is not None:
            log_r = lp - old
            # clamp's derivative is 0 outside ±RATIO_LOG_CLAMP: PPO's r carries no gradient there
            unclamped = log_r.abs() <= RATIO_LOG_CLAMP if config.kind == "ppo" else None
            log_r = log_r.clamp_(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
            metrics.ratio("approx_kl", ((torch.expm1(log_r) - log_r) * km).sum(dtype=torch.float64), km.sum())  # k3 of π_θ vs π_old
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
                active = active & unclamped
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
        return CoefTokens.apply(logprobs, per_token, coef), denominator_mask.clone(), metrics
    loss_value = numerator / count.clamp(min=1)
    return CoefLoss.apply(logprobs, loss_value, coef, scale), metrics



def _aggregate(per_token, mask, cfg: LossConfig):
    """(∂L/∂ℓ_t as a broadcastable tensor, Σ contributions, count) for each aggregation."""
    numerator, count, row_scale = row_aggregation(per_token.sum(-1), mask.sum(-1), cfg, per_token.shape[-1])
    return (row_scale / count.clamp(min=1)).unsqueeze(-1), numerator, count



def _mismatch_metrics(metrics, trainer_m, rollout_m, log_ratio, ratio, em1, m, valid, n, clamp):
    """The docs/specification.md §7 mismatch block (same values as ``correction.mismatch_metrics``), sharing passes.
    Per-token and per-row values are fp32; their sums over the batch accumulate in float64, as the
    readable path's ``Metrics.mean`` does, so a batch split into calls adds up to the same totals."""
    lr_m = log_ratio * m
    row_lr = lr_m.sum(-1)  # [B] Σ_t log ρ_t (clamped per token)
    em1_m = em1 * m
    metrics.ratio("kl_k1", -row_lr.sum(dtype=torch.float64), n)
    metrics.ratio("kl_k3", (em1_m - lr_m).sum(dtype=torch.float64), n)  # Σ (ρ − 1 − log ρ)
    # ρ² overflows fp32 beyond log ρ = 44, reachable only with log_clamp > 44 (or None)
    if clamp > 44:
        em1_m, em1, ratio = em1_m.double(), em1.double(), ratio.double()
    metrics.ratio("chi2_token", (em1_m * (em1 + 2.0)).sum(dtype=torch.float64), n)  # Σ (ρ² − 1), no cancellation near ρ = 1
    rho_m = ratio * m
    # ESS is a ratio of sums of ρ and ρ²: no cancellation, so the plain sums are exact enough
    metrics._put("ess", "ess", torch.stack([rho_m.sum(dtype=torch.float64), (rho_m * ratio).sum(dtype=torch.float64), n.double()]))
    rows = valid.any(-1)
    rows_f = rows.float()
    n_rows = rows.sum()
    row_n = m.sum(-1).clamp(min=1)
    mean_train = trainer_m.sum(-1) / row_n
    mean_rollout = rollout_m.sum(-1) / row_n
    seq = row_lr.double().clamp(-clamp, clamp)
    metrics.ratio("chi2_seq", (torch.expm1(2.0 * seq) * rows_f).sum(dtype=torch.float64), n_rows)
    metrics.ratio("ppl_train", (ops.safe_exp(-mean_train, None) * rows_f).sum(dtype=torch.float64), n_rows)
    metrics.ratio("ppl_rollout", (ops.safe_exp(-mean_rollout, None) * rows_f).sum(dtype=torch.float64), n_rows)
    diff = (rollout_m - trainer_m).sum(-1) / row_n  # per-token differences: no cancellation
    metrics.ratio("log_ppl_diff", (diff * rows_f).sum(dtype=torch.float64), n_rows)
    metrics.ratio("ppl_ratio", (ops.safe_exp(diff, None) * rows_f).sum(dtype=torch.float64), n_rows)
    abs_lr = lr_m.abs_()  # 0 off the mask and ≥ 0: its max is the max over the mask
    metrics.ratio("abs_logp_diff_mean", abs_lr.sum(dtype=torch.float64), n)
    metrics._put("abs_logp_diff_max", "max", torch.stack([abs_lr.amax(), n]).double())
    # NeMo-RL's token_mult_prob_error: Σ exp(|log ρ|) over valid tokens (exp(0) = 1 off the mask is removed by m)
    metrics.ratio("mult_prob_error", (torch.exp(abs_lr) * m).sum(dtype=torch.float64), n)
    prob_diff = (torch.exp(trainer_m) - torch.exp(rollout_m)).abs_()  # exp(0) − exp(0) = 0 off the mask
    metrics.ratio("prob_diff_mean", prob_diff.sum(dtype=torch.float64), n)
    metrics._put("prob_diff_max", "max", torch.stack([prob_diff.amax(), n]).double())
    metrics.sum("nonfinite_tokens", torch.zeros((), device=m.device))
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

