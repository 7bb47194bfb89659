"""The reference implementation — the readable oracle every faster rung is tested against.

It computes the table of docs/specification.md §5 (the one copy of the losses' formulas: each
``kind``'s per-token loss, the IS weights of §3, the KL term on the ``kl_mask`` tokens to
``ref_logprobs`` or μ, each ``agg``'s division and its ``denominator``) term by term, each loss in
its own function below, with autograd through every intermediate.
"""

from __future__ import annotations

import math

import torch

from offpolicy.core import centering, ops
from offpolicy.core.config import LossConfig
from offpolicy.core.correction import correct, sanitize, validate_inputs
from offpolicy.core.kernels.common import RATIO_LOG_CLAMP, UpcastSaturating
from offpolicy.core.kl import kl_penalty
from offpolicy.core.metrics import Metrics

NAME = "reference"


def supports(config: LossConfig, ref_logprobs: torch.Tensor | None) -> bool:
    """The reference computes every configuration."""
    return True


def preferred(mask: torch.Tensor) -> bool:
    return True


def _clip(x: torch.Tensor, eps_low: float | None, eps_high: float | None) -> torch.Tensor:
    if eps_low is None and eps_high is None:
        return x
    return x.clamp(
        min=None if eps_low is None else 1.0 - eps_low,
        max=None if eps_high is None else 1.0 + eps_high,
    )


def _ratio(logprobs: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.exp((logprobs - old).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))


def capped_ratio(logprobs: torch.Tensor, old: torch.Tensor, cap: float) -> torch.Tensor:
    """r̃ = exp(min(log r, log C) + log π_θ − sg(log π_θ)): the value min(r, C), the gradient
    ∂r̃/∂log π_θ = r̃ kept where r > C (prime-rl ``max_importance_ratio``, ``_capped_importance_ratio``)."""
    log_r = (logprobs - old).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
    return torch.exp(log_r.detach().clamp(max=math.log(cap)) + (logprobs - logprobs.detach()))


def ppo_token_loss(logprobs, old, adv, cfg: LossConfig, mask, metrics: Metrics) -> torch.Tensor:
    """Clipped surrogate (+ dual clip); records clip_fraction and dual_clip_fraction. With
    ``ratio_value_cap`` C the ratio is ``capped_ratio`` (value min(r, C), gradient kept) before the clip,
    and ``ratio_capped`` records the share of tokens with r > C."""
    if cfg.ratio_value_cap is not None:
        ratio = capped_ratio(logprobs, old, cfg.ratio_value_cap)
        metrics.mean("ratio_capped", (logprobs - old).detach() > math.log(cfg.ratio_value_cap), mask)
    else:
        ratio = _ratio(logprobs, old)
    unclipped = -adv * ratio
    clipped = -adv * _clip(ratio, cfg.clip_low, cfg.clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics.mean("clip_fraction", clipped > unclipped, mask)
    if cfg.dual_clip is not None:
        floor = -adv * cfg.dual_clip
        negative = adv < 0
        metrics.mean("dual_clip_fraction", negative & (loss > floor), mask)
        loss = torch.where(negative, torch.minimum(loss, floor), loss)
    return loss


def sequence_ratio_and_advantage(logprobs, old, adv, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence form's ratio and advantage, broadcast to ``[B, T]`` (AReaL
    ``_compute_sequence_level_ratio_and_advantages``, importance_sampling_level sequence):

        s = exp(clamp(mean_t(log π_θ − log π_old), ±20))   gradient through the mean: ∂s/∂log π_θ,t = s/n
        Ā = mean_t A_t                                      (over the row's surviving tokens)
    """
    seq_log_ratio = ops.masked_mean(logprobs - old, mask, dim=-1).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)  # [B]
    seq_adv = ops.masked_mean(adv, mask, dim=-1)  # [B]
    return ops.broadcast_rows(torch.exp(seq_log_ratio), logprobs), ops.broadcast_rows(seq_adv, logprobs)


def _dual_clip(loss, adv, cfg: LossConfig, mask, metrics: Metrics) -> torch.Tensor:
    """For A < 0: ℓ = min(ℓ, −c·A) (records dual_clip_fraction); no-op without ``dual_clip``."""
    if cfg.dual_clip is None:
        return loss
    floor = -adv * cfg.dual_clip
    negative = adv < 0
    metrics.mean("dual_clip_fraction", negative & (loss > floor), mask)
    return torch.where(negative, torch.minimum(loss, floor), loss)


def gspo_token_loss(logprobs, old, adv, cfg: LossConfig, mask, metrics: Metrics) -> torch.Tensor:
    """GSPO, with s = exp(mean_t(log π_θ − log π_old)) per row; ℓ = −min(s'·A', clip(s')·A'),
    then the dual clip, where

        gspo_form token (GSPO-token):  s'_t = sg(s)·π_θ/sg(π_θ),  A' = A_t    ∂ℓ_t/∂log π_θ,t = −A_t·s
        gspo_form sequence (GSPO):     s' = s (grad through the mean), A' = Ā ∂(Σ_t w_t ℓ_t)/∂log π_θ,j = −Ā·s·mean_t w_t

    (unclipped rows). Their values agree where A_t = Ā; their gradients only when also the IS
    weights w_t are equal within the row: the sequence form spreads the row's mean weight (and
    mean advantage) over its tokens, the token form keeps each token's own."""
    if cfg.gspo_form == "sequence":
        ratio, adv = sequence_ratio_and_advantage(logprobs, old, adv, mask)
    else:
        seq_log_ratio = ops.masked_mean(logprobs - old, mask, dim=-1).detach()  # [B]
        seq_ratio = torch.exp(seq_log_ratio.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))
        ratio = ops.broadcast_rows(seq_ratio, logprobs) * torch.exp(logprobs - logprobs.detach())  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * _clip(ratio, cfg.clip_low, cfg.clip_high)
    metrics.mean("clip_fraction", clipped > unclipped, mask)
    return _dual_clip(torch.maximum(unclipped, clipped), adv, cfg, mask, metrics)


def cispo_token_loss(logprobs, old, adv, cfg: LossConfig, mask, metrics: Metrics) -> torch.Tensor:
    """CISPO: REINFORCE through log π_θ with a clipped, detached ratio as weight."""
    ratio = _ratio(logprobs, old).detach()
    kept = _clip(ratio, cfg.clip_low, cfg.clip_high)
    metrics.mean("clip_fraction", kept != ratio, mask)
    return -kept * adv * logprobs


def sapo_token_loss(logprobs, old, adv, cfg: LossConfig, mask, metrics: Metrics) -> torch.Tensor:
    """SAPO: a sigmoid gate replaces the hard clip; the gate's slope in r is 1 at r = 1.
    ``sapo_level`` sequence gates the row's s = exp(mean_t log r_t) (gradient through the mean)
    with Ā, like GSPO's sequence form (``sequence_ratio_and_advantage``)."""
    if cfg.sapo_level == "sequence":
        ratio, adv = sequence_ratio_and_advantage(logprobs, old, adv, mask)
    else:
        ratio = _ratio(logprobs, old)
    tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * adv


def reinforce_token_loss(logprobs, old, adv, cfg: LossConfig, mask, metrics: Metrics) -> torch.Tensor:
    """REINFORCE: −A·log π_θ (importance weights, if any, are applied by the caller)."""
    return -adv * logprobs


TOKEN_LOSSES = {
    "ppo": ppo_token_loss,
    "gspo": gspo_token_loss,
    "cispo": cispo_token_loss,
    "sapo": sapo_token_loss,
    "reinforce": reinforce_token_loss,
}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, count) of the aggregated loss: Σ of token or row contributions, and the
    number of tokens or non-empty rows they are averaged over (or the global count).

    ``per_token`` is already 0 off the loss mask; ``mask`` is the denominator mask. The count
    may be 0 (everything rejected); the caller divides by max(count, 1), giving a zero loss
    with a zero gradient, never NaN.
    """
    if cfg.agg == "token-mean":
        count = cfg.global_tokens if cfg.global_tokens is not None else mask.sum()
        return per_token.sum(), torch.as_tensor(count, dtype=per_token.dtype, device=per_token.device)
    row_sum = per_token.sum(dim=-1)  # [B]
    row_count = mask.sum(dim=-1)  # [B]
    if cfg.agg == "seq-mean-token-mean":
        row_loss = row_sum / row_count.clamp(min=1).to(per_token.dtype)
    elif cfg.agg == "seq-mean-token-sum":
        row_loss = row_sum
    else:  # seq-mean-token-sum-norm
        row_loss = row_sum / float(cfg.max_len if cfg.max_len is not None else per_token.shape[-1])
    count = cfg.global_seqs if cfg.global_seqs is not None else (row_count > 0).sum()
    return row_loss.sum(), torch.as_tensor(count, dtype=per_token.dtype, device=per_token.device)



def policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config: LossConfig, reduce: bool,
                ref_logprobs: torch.Tensor | None = None, support: centering.Support | None = None):
    """The readable policy loss; arguments as ``offpolicy.policy_loss`` (already checked there).
    ``support``: score centering's ``Support``, scored by the trainer."""
    cfg = config
    corr_cfg = cfg.correction
    if corr_cfg is not None:
        corr = correct(
            None if corr_cfg.anchor == "rollout" else old_logprobs,
            rollout_logprobs,
            mask,
            corr_cfg,
            logprobs=logprobs,
            advantages=advantages,
            ref_logprobs=ref_logprobs,
        )
        if corr.old_logprobs is not None:
            old_logprobs = corr.old_logprobs  # after the nonfinite policy (neutral: never the bad value)
        metrics, weights = corr.metrics, corr.weights
        loss_mask, valid = corr.mask.bool(), corr.valid_mask.bool()
        kl_weights = weights if corr_cfg.kl_is_weight else None
        count_mask = corr.count_mask.bool()
    else:
        valid = validate_inputs(mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
        valid = sanitize(
            valid, "error", {}, {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
        ).valid
        loss_mask, metrics, weights, kl_weights = valid, Metrics(), None, None
        count_mask = valid
    if ref_logprobs is not None and corr_cfg is None:
        validate_inputs(mask, ref_logprobs=ref_logprobs)
        sanitize(loss_mask, "error", {}, {"ref_logprobs": ref_logprobs})

    # Off the loss mask inputs may be NaN/garbage: select them away *before* any arithmetic,
    # so neither the forward nor the backward ever touches them.
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    # fp32 from here; the gradient goes back to π_θ's dtype saturating (fp16 would overflow to inf)
    lp_in = UpcastSaturating.apply(logprobs) if logprobs.dtype in (torch.float16, torch.bfloat16) else logprobs.float()
    lp = torch.where(loss_mask, lp_in, zero)
    old = None if old_logprobs is None else torch.where(loss_mask, old_logprobs.float().detach(), zero)
    adv = torch.where(loss_mask, advantages.float().detach(), zero)

    per_token = TOKEN_LOSSES[cfg.kind](lp, old, adv, cfg, loss_mask, metrics)
    if weights is not None:
        per_token = per_token * weights  # after clipping and the dual clip (docs/specification.md §3)
    per_token = torch.where(loss_mask, per_token, zero)
    if ref_logprobs is not None:
        # the KL term's own tokens: the kept ones, or (prime-rl's kl_tau) every valid token or only
        # the rejected ones, which need π_θ where the policy term had it selected away
        kl_mask = {"kept": loss_mask, "valid": valid, "rejected": valid & ~loss_mask}[cfg.kl_mask]
        lp_kl = lp if cfg.kl_mask == "kept" else torch.where(kl_mask, lp_in, zero)
        ref = torch.where(kl_mask, ref_logprobs.float(), zero)
        kl = kl_penalty(lp_kl, ref, cfg.kl_kind)
        metrics.mean("kl_ref", kl.detach(), kl_mask)
        if cfg.kl_coef > 0:
            term = cfg.kl_coef * (kl if kl_weights is None else kl * kl_weights)
            per_token = per_token + torch.where(kl_mask, term, zero)
    if cfg.score_centering is not None:
        # sg(A_t)·Σ_v sg(q_v c_v)·log p_v on every valid token of a kept row (offpolicy.core.centering); without a
        # recorded support, none (as prime-rl), and the metric says so
        applied = support is not None
        metrics.mean("score_centering/applied", torch.full_like(valid, applied), valid)
        if applied:
            per_token = per_token + centering.score_centering_term(
                cfg, corr if corr_cfg is not None else None, valid, advantages, support, metrics)
    if old is not None:
        log_r = (lp - old).detach().clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
        metrics.mean("approx_kl", torch.expm1(log_r) - log_r, loss_mask)  # k3 of π_θ vs π_old (expm1: no fp32 floor)

    agg_mask = count_mask  # valid (fixed), surviving (renormalize), or after the first n rules
    numerator, count = aggregate(per_token, agg_mask, cfg)
    loss = numerator / count.clamp(min=1)
    if cfg.global_tokens is not None or cfg.global_seqs is not None:
        metrics.sum("loss", loss)  # already divided by the global count: parts add up
    else:
        # the true count, so that merging micro-batches weighs each by its tokens (or rows);
        # a batch with nothing left reports NaN here while returning a zero loss
        metrics.ratio("loss", numerator, count)
    if not reduce:
        return per_token, agg_mask.float(), metrics
    return loss, metrics
