"""Measure and correct the rollout–training mismatch (docs/specification.md §2–§4, §6, §7).

``correct`` runs four stages in a fixed order, each a small function below:

1. ``sanitize``  — validate inputs; non-finite values on valid tokens follow ``nonfinite``.
2. ``reject_*``  — hard rules remove tokens or rows from the loss mask (``reject_mode``).
3. ``weights``   — soft IS weights on the surviving mask (``weight``).
4. ``normalize`` — optional division by the batch mean weight (across DP ranks).

The log-ratio compares the trainer with the sampler μ; ``anchor`` picks the trainer side:
    old:     log ρ_t = log π_old(y_t) − log μ(y_t)
    rollout: log ρ_t = sg(log π_θ(y_t)) − log μ(y_t)   (bypass: only rejection uses it)
    current: log ρ_t = sg(log π_θ(y_t)) − log μ(y_t)   (one weight for mismatch + staleness)
and is clamped to [−L, L] (``log_clamp``) before any ``exp``.

A bound chosen from the data (``{rule: ess | quantile}``, the ``m2`` rule) is read off the units
the stage sees in this call (``offpolicy.core.thresholds``) and then applied as a fixed number, so
it is per call (one micro-batch, one rank) unless ``resolve_thresholds`` fixed it for a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from offpolicy.core import ops
from offpolicy.core.config import (
    BinaryKLRule,
    CorrectionConfig,
    DivergenceRule,
    M2Rule,
    MultErrorRule,
    OPSMRule,
    ProbDiffRule,
    RatioRule,
    WeightConfig,
    is_adaptive,
    rule_name,
)
from offpolicy.core.metrics import Metrics
from offpolicy.core.thresholds import bound_value, m2_cut

_MAX_LOGPROB = 1e-6


@dataclass(frozen=True)
class Correction:
    """Result of ``correct``.

    Attributes:
        weights:    [B, T] fp32, detached; 0 wherever ``mask`` is 0.
        mask:       [B, T] fp32 0/1 loss mask after sanitising and rejection.
        metrics:    mismatch, weight and rejection metrics (docs/specification.md §7).
        log_ratio:  [B, T] fp32 clamped log ρ_t; 0 on invalid tokens.
        valid_mask: [B, T] fp32 0/1 mask after sanitising, before rejection
                    (the denominator of ``denominator: fixed``).
        count_mask: [B, T] fp32 0/1 mask the loss divides by: ``valid_mask`` under
                    ``denominator: fixed``, ``mask`` under ``renormalize``, the tokens left
                    after the first n rules under an integer n (AReaL's M2PO count).
    """

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: Metrics
    log_ratio: torch.Tensor
    valid_mask: torch.Tensor
    # [B, T] fp32 log π_old for PPO's own ratio after the nonfinite policy (anchor old: π_old;
    # rollout: μ), 0 off valid tokens; None under anchor current (the loss takes π_old as given)
    old_logprobs: torch.Tensor | None = None
    count_mask: torch.Tensor | None = None
    # score centering (docs/estimators.md#score-centering): [B, T] bool, the valid tokens of the rows
    # every row-level rule kept (token-level rules left out), and the mean weight ``normalize`` divided by
    row_mask: torch.Tensor | None = None
    weight_mean: float = 1.0


# =========================================================================== 1. sanitize
def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_complex():
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError(
                f"mask must be 0/1 (1 = token counts); found {int(bad.sum())} other value(s), "
                f"e.g. {mask[bad][0].item()!r}"
            )
        return mask != 0
    raise ValueError(f"mask must be bool or 0/1 numbers, got dtype {mask.dtype}")


def _first_positions(bad: torch.Tensor, k: int = 3) -> str:
    return ", ".join(str(tuple(p)) for p in bad.nonzero()[:k].tolist())


def validate_inputs(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """Check shapes, dtypes and the mask; return the mask as bool ``[B, T]``.

    Raises:
        ValueError: naming the tensor, its shape and the count of offending entries —
            shapes differ from the mask's, a non-float tensor, a non-0/1 mask, no valid
            token, or a finite log-prob > 1e-6 on a valid token (a bug upstream).
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T]; got shape {tuple(mask.shape)}")
    valid = _as_bool_mask(mask)
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if tensor.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but mask has {tuple(mask.shape)}; they must match")
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a float tensor; got dtype {tensor.dtype}")
        if name.endswith("logprobs"):
            positive = valid & torch.isfinite(tensor) & (tensor > _MAX_LOGPROB)
            if bool(positive.any()):
                raise ValueError(
                    f"{name} has {int(positive.sum())} positive log-prob(s) on valid tokens (max "
                    f"{tensor[positive].max().item():.4g}, first at {_first_positions(positive)}): a log-prob "
                    "is ≤ 0, so the upstream gather or sign is wrong"
                )
    if not bool(valid.any()):
        raise ValueError(f"mask {tuple(mask.shape)} has no valid token: nothing to train on")
    return valid


@dataclass(frozen=True)
class Sanitized:
    valid: torch.Tensor  # [B, T] bool, tokens that count after the nonfinite policy
    neutral: torch.Tensor  # [B, T] bool, tokens kept with ρ := 1 (nonfinite: neutral)
    count: torch.Tensor  # number of valid tokens that held a non-finite value
    bad: dict[str, torch.Tensor]  # per input name: [B, T] bool, valid tokens holding a non-finite value


def sanitize(
    valid: torch.Tensor,
    policy: str,
    ratio_inputs: dict[str, torch.Tensor | None],
    loss_inputs: dict[str, torch.Tensor | None],
) -> Sanitized:
    """Apply the ``nonfinite`` policy (docs/specification.md §6) to the valid tokens.

    ``ratio_inputs`` (the anchor's trainer side and log μ) feed log ρ; under ``neutral`` a token
    where exactly one of them is bad stays, the caller replacing the bad value by the other
    side's (so log ρ_t = 0, ρ_t = 1); a token where both are bad is masked. ``loss_inputs``
    (π_θ, advantages, ...) have no neutral value, so under ``neutral`` their bad tokens are
    masked like ``mask_token``.

    Raises:
        ValueError: under ``error``, naming the tensor, the count and the first positions.
    """
    bad = {"ratio": torch.zeros_like(valid), "loss": torch.zeros_like(valid)}
    per_input: dict[str, torch.Tensor] = {}
    both_ratio = valid.clone()  # every ratio input bad (neutral has nothing to substitute)
    n_ratio = 0
    for group, tensors in (("ratio", ratio_inputs), ("loss", loss_inputs)):
        for name, tensor in tensors.items():
            if tensor is None:
                continue
            bad_here = valid & ~torch.isfinite(tensor)
            if policy == "error" and bool(bad_here.any()):
                raise ValueError(
                    f"{name} has {int(bad_here.sum())} non-finite value(s) on valid tokens, first at "
                    f"{_first_positions(bad_here)}; fix the source or set correction.nonfinite to "
                    "mask_token, mask_sequence or neutral"
                )
            bad[group] |= bad_here
            per_input[name] = bad_here
            if group == "ratio":
                both_ratio &= bad_here
                n_ratio += 1
    bad_any = bad["ratio"] | bad["loss"]
    neutral = torch.zeros_like(valid)
    if policy == "mask_sequence":
        valid = valid & ~bad_any.any(dim=-1, keepdim=True)
    elif policy == "neutral":
        valid = valid & ~bad["loss"]
        if n_ratio == 2:
            valid = valid & ~both_ratio
        neutral = bad["ratio"] & valid
    else:  # mask_token (or error, with nothing bad)
        valid = valid & ~bad_any
    count = bad_any.sum()
    return Sanitized(valid=valid, neutral=neutral, count=count, bad=per_input)


# =========================================================================== log-ratio
def trainer_side(
    anchor: str, old_logprobs: torch.Tensor | None, logprobs: torch.Tensor | None
) -> tuple[str, torch.Tensor]:
    """(name, tensor) of the trainer log-probs compared with μ under ``anchor``."""
    if anchor == "old":
        if old_logprobs is None:
            raise ValueError("anchor 'old' needs old_logprobs (the trainer's recompute with the sampling weights)")
        return "old_logprobs", old_logprobs
    if logprobs is not None:
        return "logprobs", logprobs.detach()
    if anchor == "rollout" and old_logprobs is not None:
        return "old_logprobs", old_logprobs
    raise ValueError(f"anchor '{anchor}' compares sg(log π_θ) with μ: pass logprobs=")


# =========================================================================== 2. rejection
@dataclass(frozen=True)
class RuleInputs:
    """What a rejection rule may read, fp32 ``[B, T]`` with 0 on invalid tokens."""

    log_ratio: torch.Tensor  # clamped log ρ_t
    trainer: torch.Tensor  # log π_train (anchor's side)
    rollout: torch.Tensor  # log μ
    current: torch.Tensor | None  # sg(log π_θ)
    advantages: torch.Tensor | None
    clamp: float


def _row_stat(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    if how == "seq_sum":
        return ops.masked_sum(per_token, mask, dim=-1)
    if how == "seq_mean":
        return ops.masked_mean(per_token, mask, dim=-1)
    return ops.masked_max(per_token, mask, dim=-1)  # seq_max


def reject_ratio(rule: RatioRule, b: RuleInputs, mask: torch.Tensor) -> torch.Tensor:
    """Keep-mask of a ratio rule: token keeps low ≤ ρ_t ≤ high; sequence keeps low ≤ Π ρ_t ≤ high;
    geometric keeps low ≤ exp(mean log ρ_t) ≤ high; any_token drops a row if any ρ_t leaves the band."""
    if rule.level == "token":
        return ops.in_band(ops.safe_exp(b.log_ratio, b.clamp), rule.low, rule.high)
    if rule.level == "any_token":
        outside = mask & ~ops.in_band(ops.safe_exp(b.log_ratio, b.clamp), rule.low, rule.high)
        return ops.broadcast_rows(~outside.any(dim=-1), mask)
    row = ops.row_log_ratio(b.log_ratio, mask, geometric=rule.level == "geometric")  # [B]
    return ops.broadcast_rows(ops.in_band(ops.safe_exp(row, b.clamp), rule.low, rule.high), mask)


def reject_divergence(rule: DivergenceRule, b: RuleInputs, mask: torch.Tensor) -> torch.Tensor:
    """Keep-mask of a k1/k2/k3 rule: k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ, per token or
    summed / averaged / maxed over the row's valid tokens, kept inside [low, high].

    direction pi_mu (AReaL) writes the estimators with log ρ negated — k1 = log ρ,
    k3 = 1/ρ − 1 + log ρ — so the same code reads them off −log ρ."""
    x = b.log_ratio if rule.direction == "mu_pi" else -b.log_ratio
    if rule.stat == "k1":
        per_token = -x
    elif rule.stat == "k2":
        per_token = 0.5 * x * x
    else:
        per_token = ops.k3(x, b.clamp)
    if rule.level == "token":
        return ops.in_band(per_token, rule.low, rule.high)
    return ops.broadcast_rows(ops.in_band(_row_stat(per_token, mask, rule.level), rule.low, rule.high), mask)


def reject_opsm(rule: OPSMRule, b: RuleInputs, mask: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2 OPSM: drop a row if mean_t A < 0 and mean_t(log μ − sg(log π_θ)) > δ."""
    if b.current is None or b.advantages is None:
        raise ValueError("reject rule 'opsm' needs logprobs= (π_θ) and advantages= passed to correct()")
    negative = ops.masked_mean(b.advantages, mask, dim=-1) < 0
    drifted = ops.masked_mean(b.rollout - b.current, mask, dim=-1) > rule.delta
    return ops.broadcast_rows(~(negative & drifted), mask)


def binary_kl_values(rule: BinaryKLRule, b: RuleInputs) -> torch.Tensor:
    """bkl_t of ``rule.direction``: mu_pi KL(Bern(μ)‖Bern(π_train)), pi_mu the reverse, both the max."""
    if rule.direction == "mu_pi":
        return ops.binary_kl(b.rollout, b.trainer)
    if rule.direction == "pi_mu":
        return ops.binary_kl(b.trainer, b.rollout)
    return torch.maximum(ops.binary_kl(b.rollout, b.trainer), ops.binary_kl(b.trainer, b.rollout))


def reject_binary_kl(rule: BinaryKLRule, b: RuleInputs, mask: torch.Tensor) -> torch.Tensor:
    """Binary KL gate, bkl_t = max(0, KL(Bern(μ(y_t)) ‖ Bern(π_train(y_t)))) (``ops.binary_kl``;
    ``direction`` pi_mu swaps the arguments, both takes the larger of the two).

    seq_mean (OpenRLHF 0.11): keep a row if mean_t bkl_t ≤ high.
    token: keep a token if bkl_t ≤ high; with ``by_advantage`` (SkyRL DPPO Binary-KL) drop only
    A_t > 0 tokens with π_train > μ and bkl_t > high, and A_t < 0 tokens with π_train < μ and
    bkl_t > high_negative (default high)."""
    bkl = binary_kl_values(rule, b)
    if rule.level == "seq_mean":
        return ops.broadcast_rows(ops.masked_mean(bkl, mask, dim=-1) <= rule.high, mask)
    if not rule.by_advantage:
        return bkl <= rule.high
    if b.advantages is None:
        raise ValueError("reject rule 'binary_kl' with by_advantage needs advantages= passed to correct()")
    high_negative = rule.high if rule.high_negative is None else rule.high_negative
    rose = b.trainer > b.rollout  # π_train > μ (log is monotone: no exp needed)
    drop = ((b.advantages > 0) & rose & (bkl > rule.high)) | ((b.advantages < 0) & (b.trainer < b.rollout)
                                                                & (bkl > high_negative))
    return ~drop


def reject_mult_error(rule: MultErrorRule, b: RuleInputs, mask: torch.Tensor) -> torch.Tensor:
    """NeMo-RL seq_logprob_error_threshold: keep a row if mean_t exp(|log ρ_t|) ≤ high."""
    error = ops.safe_exp(b.log_ratio.abs(), b.clamp)  # max(ρ, 1/ρ) ≥ 1
    return ops.broadcast_rows(ops.masked_mean(error, mask, dim=-1) <= rule.high, mask)


def reject_prob_diff(rule: ProbDiffRule, b: RuleInputs, mask: torch.Tensor) -> torch.Tensor:
    """prime-rl trust region: d_t = π_train(y_t) − μ(y_t); drop d_t > high or d_t < −low
    (``by_advantage``: high only where A_t > 0, low only where A_t ≤ 0)."""
    d = torch.exp(b.trainer) - torch.exp(b.rollout)  # [B, T], in [−1, 1]
    too_high = d > rule.high if rule.high is not None else torch.zeros_like(mask)
    too_low = d < -rule.low if rule.low is not None else torch.zeros_like(mask)
    if rule.by_advantage:
        if b.advantages is None:
            raise ValueError("reject rule 'prob_diff' with by_advantage needs advantages= passed to correct()")
        drop = torch.where(b.advantages > 0, too_high, too_low)
    else:
        drop = too_high | too_low
    return ~drop


_RULES = {
    RatioRule: reject_ratio,
    DivergenceRule: reject_divergence,
    OPSMRule: reject_opsm,
    BinaryKLRule: reject_binary_kl,
    MultErrorRule: reject_mult_error,
    ProbDiffRule: reject_prob_diff,
}


def record_bound(metrics: Metrics, key: str, value: float | None, device: torch.device) -> None:
    """A chosen bound, reducer mean over calls: [value, 1], or [0, 0] (NaN = no data) without units."""
    parts = torch.tensor([0.0 if value is None else value, 0.0 if value is None else 1.0], dtype=torch.float64,
                         device=device)
    metrics.ratio(key, parts[0], parts[1])


def chosen_band(bounded: Any, values: torch.Tensor, *, fill_empty: bool, metrics: Metrics | None = None,
                key: str = "") -> dict[str, float | None]:
    """``{low, high}`` of a rule or weight with every data-chosen bound replaced by the number it
    takes over ``values`` (``thresholds.bound_value``; fixed bounds pass through). With
    ``fill_empty`` a band left open on both sides (no unit to read a bound from) becomes
    high = +inf, so the stage keeps everything. With ``metrics``, each data-chosen side is
    recorded as ``<key><side>`` (see ``record_bound``)."""
    band = {}
    for side in ("low", "high"):
        bound = getattr(bounded, side)
        band[side] = bound_value(bound, values, side)
        if metrics is not None and is_adaptive(bound):
            record_bound(metrics, f"{key}{side}", band[side], values.device)
    if fill_empty and band["low"] is None and band["high"] is None:
        band["high"] = math.inf
    return band


def rule_units(rule: RatioRule | M2Rule, log_ratio: torch.Tensor, seen: torch.Tensor, log_clamp: float | None) -> torch.Tensor:
    """The 1-D values a data-chosen bound of ``rule`` is read from, over the tokens it sees:
    ratio rules at token / any_token level: ρ_t of the seen tokens; at sequence / geometric level:
    the row ratios of the rows with a seen token; m2: (log ρ_t)² of the seen tokens."""
    clamp = ops.effective_log_clamp(log_clamp)
    if isinstance(rule, M2Rule):
        return (log_ratio * log_ratio)[seen]
    if rule.level in ("token", "any_token"):
        return ops.safe_exp(log_ratio, clamp)[seen]
    row = ops.row_log_ratio(log_ratio, seen, geometric=rule.level == "geometric")  # [B]
    return ops.safe_exp(row, clamp)[seen.any(dim=-1)]


def resolve_rule(rule: Any, b: RuleInputs, seen: torch.Tensor, log_clamp: float | None, name: str, metrics: Metrics):
    """A rule with data-chosen bounds → the same rule with the numbers read off this call's
    tokens (``offpolicy.core.thresholds``), recording them: ``<name>/low`` and ``<name>/high`` (the
    chosen ratio bounds), or for m2 ``<name>/m2_before`` (mean (log ρ)² over the seen tokens).
    An m2 rule becomes ``{k2, token, high: h/2}`` (keep (log ρ)² ≤ h). Other rules pass through."""
    if isinstance(rule, M2Rule):
        m2 = b.log_ratio * b.log_ratio
        metrics.mean(f"{name}/m2_before", m2, seen)
        cut = m2_cut(m2[seen], rule.high)
        return DivergenceRule.model_construct(stat="k2", level="token", low=None, high=cut / 2)
    if not getattr(rule, "adaptive", False):
        return rule
    values = rule_units(rule, b.log_ratio, seen, log_clamp)
    # no unit seen: nothing to reject
    return rule.model_copy(update=chosen_band(rule, values, fill_empty=True, metrics=metrics, key=f"{name}/"))


def is_token_rule(rule: Any) -> bool:
    """Whether a rule decides token by token (a token's fate depends on that token alone, given fixed
    bounds), rather than for a whole row."""
    if isinstance(rule, (M2Rule, ProbDiffRule)):
        return True
    return isinstance(rule, (RatioRule, DivergenceRule, BinaryKLRule)) and rule.level == "token"


def apply_rejection(cfg: CorrectionConfig, b: RuleInputs, valid: torch.Tensor, input_mask: torch.Tensor, metrics: Metrics,
                    after: list[torch.Tensor] | None = None, rows: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Apply ``cfg.reject`` in order; return the surviving mask (and, into ``after``, the masks left
    after the first 0, 1, …, n rules, the last the surviving one: an integer ``denominator`` counts one;
    into ``rows``, each row-level rule's decision broadcast to ``[B, T]``).

    independent: every rule is evaluated on ``valid``; results are ANDed (verl).
    sequential:  each rule sees the mask left by the rules before it (SkyRL).
    Per rule, ``reject/<i>_<stat>_<level>/masked_fraction`` is the fraction of input tokens it
    removed and ``.../masked_fraction_seq`` the fraction of non-empty input rows it touched; a
    binary_kl rule adds ``.../binary_kl_mean``, the mean bkl_t over the tokens it saw.
    """
    n_tokens = input_mask.sum()
    n_rows = input_mask.any(dim=-1).sum()
    current = valid
    for i, rule in enumerate(cfg.reject):
        if after is not None:
            after.append(current)
        seen = current if cfg.reject_mode == "sequential" else valid
        name = f"reject/{rule_name(i, rule)}"
        fixed = resolve_rule(rule, b, seen, cfg.log_clamp, name, metrics)
        decision = _RULES[type(fixed)](fixed, b, seen)
        if rows is not None and not is_token_rule(rule):
            rows.append(decision)
        keep = decision & seen
        removed = seen & ~keep
        metrics.ratio(f"{name}/masked_fraction", removed.sum(), n_tokens)
        metrics.ratio(f"{name}/masked_fraction_seq", removed.any(dim=-1).sum(), n_rows)
        if isinstance(rule, M2Rule):
            metrics.mean(f"{name}/m2_after", b.log_ratio * b.log_ratio, keep)
        elif isinstance(rule, BinaryKLRule):  # mean bkl the rule read (≥ 0: ops.binary_kl clamps fp32's negatives)
            metrics.mean(f"{name}/binary_kl_mean", binary_kl_values(rule, b), seen)
        current = current & keep
    if after is not None:
        after.append(current)
    return current


# =========================================================================== 3–4. weights
def weight_fn(w: WeightConfig, ratio: torch.Tensor) -> torch.Tensor:
    """truncate: clamp(ρ, low, high); mask: ρ · 1[low ≤ ρ ≤ high]."""
    if w.mode == "truncate":
        if w.low is None and w.high is None:
            return ratio  # the raw ratio (openrlhf:seq-mask-tis)
        return ratio.clamp(min=w.low, max=w.high)
    return ratio * ops.in_band(ratio, w.low, w.high)


def segment_index(input_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] long: the segment of each token, numbered b·T + j for the j-th maximal run of
    consecutive tokens with mask = 1 in row b (ROLL ``compute_segment_masked_mean``: one assistant
    turn between masked tool/environment tokens). Values off the mask are arbitrary."""
    m = input_mask.bool()
    B, T = m.shape
    starts = m & ~torch.nn.functional.pad(m[:, :-1], (1, 0), value=False)  # [B, T] first token of a run
    j = (torch.cumsum(starts.to(torch.int64), dim=-1) - 1).clamp(min=0)
    return j + torch.arange(B, device=m.device).unsqueeze(-1) * T


def _units(level: str, log_ratio: torch.Tensor, mask: torch.Tensor, clamp: float, input_mask: torch.Tensor | None):
    """(unit ratios, unit mask, broadcast) of a weight level: token → [B, T]; sequence /
    geometric → [B] row ratios; segment → [B·T] segment ratios exp(mean_{t∈s} log ρ_t) over the
    surviving tokens of each segment of ``input_mask``. ``broadcast`` maps unit values to [B, T]."""
    if level == "token":
        return ops.safe_exp(log_ratio, clamp), mask, lambda v: v
    if level in ("sequence", "geometric"):
        row = ops.row_log_ratio(log_ratio, mask, geometric=level == "geometric")  # [B]
        return ops.safe_exp(row, clamp), mask.any(dim=-1), lambda v: ops.broadcast_rows(v, mask)
    seg = segment_index(input_mask if input_mask is not None else mask).reshape(-1)  # [B·T]
    m = mask.reshape(-1)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    total = torch.zeros(seg.numel(), dtype=log_ratio.dtype, device=log_ratio.device).index_add_(
        0, seg, torch.where(m, log_ratio.reshape(-1), zero))
    count = torch.zeros(seg.numel(), dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, seg, m.to(log_ratio.dtype))
    mean = (total / count.clamp(min=1)).clamp(-clamp, clamp)
    return ops.safe_exp(mean, clamp), count > 0, lambda v: v[seg].reshape(mask.shape)


def weight_units(w: WeightConfig, log_ratio: torch.Tensor, mask: torch.Tensor, log_clamp: float | None,
                 input_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The 1-D unit ratios a data-chosen weight bound is read from (tokens, rows or segments on
    the surviving ``mask``)."""
    ratio, unit_mask, _ = _units(w.level, log_ratio, mask, ops.effective_log_clamp(log_clamp), input_mask)
    return ratio[unit_mask]


def resolve_weight(w: WeightConfig, ratio: torch.Tensor, unit_mask: torch.Tensor, metrics: Metrics) -> WeightConfig:
    """A weight with data-chosen bounds → the same weight with the numbers read off this call's
    units, recorded as ``weight_low`` / ``weight_high`` (reducer mean: merged over micro-batches
    and ranks it is the mean of the per-call bounds, NaN if no call had a unit)."""
    if not w.adaptive:
        return w
    # a mask with no unit keeps the (empty) set as is; open truncation bounds stay open
    band = chosen_band(w, ratio[unit_mask], fill_empty=w.mode == "mask", metrics=metrics, key="weight_")
    return w.model_copy(update=band)


def compute_weights(
    w: WeightConfig, log_ratio: torch.Tensor, mask: torch.Tensor, clamp: float, metrics: Metrics,
    input_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """IS weights ``[B, T]`` on ``mask`` (docs/specification.md §3), detached, 0 off the mask.

    token: w_t = f(ρ_t); sequence: f(exp(clamp(Σ_t log ρ_t))); geometric: f(exp(clamp(mean_t log ρ_t)));
    segment: f(exp(clamp(mean_{t∈s} log ρ_t))) for each run s of ``input_mask`` (tokens of ``mask``).
    Data-chosen bounds are read off the units first (``resolve_weight``). Records the raw ratio's
    ``fraction_above_high`` / ``fraction_below_low`` over tokens (token level) or non-empty rows /
    segments.
    """
    ratio, unit_mask, broadcast = _units(w.level, log_ratio, mask, clamp, input_mask)
    w = resolve_weight(w, ratio, unit_mask, metrics)
    weights = broadcast(weight_fn(w, ratio))
    metrics.mean("fraction_above_high", ratio > w.high if w.high is not None else torch.zeros_like(unit_mask), unit_mask)
    metrics.mean("fraction_below_low", ratio < w.low if w.low is not None else torch.zeros_like(unit_mask), unit_mask)
    return torch.where(mask, weights, torch.zeros((), device=weights.device)).detach()


def weight_sum_and_count(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[Σ, n] (float64) whose ratio is the mean weight ``normalize`` divides by: token level (and
    segment, whose weights are per token): Σ_t w_t over the surviving tokens and their count;
    sequence levels: Σ over non-empty rows of each row's mean weight and the row count. Partial
    sums: micro-batches and ranks add them up to the step's."""
    if level == "token":  # summed in float64: the same total whichever rows a call holds
        return torch.stack([ops.masked_sum(weights.double(), mask), mask.sum().double()])
    rows = mask.any(dim=-1)
    row_weight = ops.masked_mean(weights, mask, dim=-1)
    return torch.stack([ops.masked_sum(row_weight.double(), rows), rows.sum().double()])


def normalizer(stats: torch.Tensor) -> float:
    """The mean weight from ``[Σ, n]``; 1.0 (no division) when it is ≤ 1e-8 (all weights ~0:
    dividing would explode)."""
    mean = float(stats[0] / stats[1].clamp(min=1))
    return mean if mean > 1e-8 else 1.0


def normalize_weights(weights: torch.Tensor, mask: torch.Tensor, level: str, mean: float | None = None) -> torch.Tensor:
    """Divide by the batch mean weight (``weight_sum_and_count``), over all data-parallel ranks
    when torch.distributed is up — or by ``mean``, the step's mean that ``resolve_thresholds``
    fixed (``weight.normalize_mean``), so that every micro-batch of a step divides alike.
    Skipped when the mean is ≤ 1e-8 (``normalizer``)."""
    mean = weight_normalizer(weights, mask, level, mean)
    return weights if mean == 1.0 else weights / mean


def weight_normalizer(weights: torch.Tensor, mask: torch.Tensor, level: str, mean: float | None = None) -> float:
    """The mean weight ``normalize_weights`` divides by (``mean`` itself when given)."""
    if mean is None:
        stats = weight_sum_and_count(weights, mask, level)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            # every rank must divide by the same mean, or DP gradients would be scaled per rank
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        mean = normalizer(stats)
    return mean


# =========================================================================== metrics (§7)
def mismatch_metrics(
    metrics: Metrics, trainer: torch.Tensor, rollout: torch.Tensor, log_ratio: torch.Tensor, valid: torch.Tensor, clamp: float
) -> None:
    """Mismatch between π_train and μ on the valid tokens, before rejection.

    kl_k1 = mean(log μ − log π_train); kl_k3 = mean(ρ − 1 − log ρ) (as expm1(log ρ) − log ρ); chi2_token = mean(ρ²) − 1;
    chi2_seq = mean_rows(Π ρ_t²) − 1; ppl_* = mean_rows exp(−mean_t log p); log_ppl_diff =
    mean_rows(mean_t log μ − mean_t log π_train); ppl_ratio = mean_rows(ppl_train / ppl_rollout);
    abs_logp_diff = |log ρ|; prob_diff = |π_train − μ|; ess = (mean ρ)² / mean(ρ²);
    mult_prob_error = mean_t exp(|log ρ_t|) = mean_t max(ρ_t, 1/ρ_t) ≥ 1 — NeMo-RL's
    ``token_mult_prob_error`` (nemo_rl/algorithms/loss_functions.py, ClippedPGLossFn:
    masked_mean(exp(|generation_logprobs − prev_logprobs|)); docs/adding-new-models.md),
    here on the clamped log ρ. Under anchor old, abs_logp_diff_mean is mean |log π_old − log μ|.
    """
    ratio = ops.safe_exp(log_ratio, clamp)
    rows = valid.any(dim=-1)
    metrics.mean("kl_k1", -log_ratio, valid)
    metrics.mean("kl_k3", ops.k3(log_ratio, clamp), valid)
    metrics.mean("chi2_token", ratio.double() ** 2 - 1.0, valid)
    seq_log = ops.row_log_ratio(log_ratio, valid, geometric=False).double().clamp(-clamp, clamp)
    metrics.mean("chi2_seq", torch.exp(2.0 * seq_log) - 1.0, rows)
    mean_train = ops.masked_mean(trainer, valid, dim=-1)  # [B]
    mean_rollout = ops.masked_mean(rollout, valid, dim=-1)
    metrics.mean("ppl_train", ops.safe_exp(-mean_train, None), rows)
    metrics.mean("ppl_rollout", ops.safe_exp(-mean_rollout, None), rows)
    # mean_t(log μ − log π) per row, not mean_t log μ − mean_t log π: the same number without
    # the cancellation of two large fp32 means
    log_ppl_diff = ops.masked_mean(rollout - trainer, valid, dim=-1)
    metrics.mean("log_ppl_diff", log_ppl_diff, rows)
    metrics.mean("ppl_ratio", ops.safe_exp(log_ppl_diff, None), rows)
    abs_diff = log_ratio.abs()
    metrics.mean("abs_logp_diff_mean", abs_diff, valid)
    metrics.max("abs_logp_diff_max", abs_diff, valid)
    metrics.mean("mult_prob_error", ops.safe_exp(abs_diff, clamp), valid)
    prob_diff = (torch.exp(trainer) - torch.exp(rollout)).abs()
    metrics.mean("prob_diff_mean", prob_diff, valid)
    metrics.max("prob_diff_max", prob_diff, valid)
    metrics.ess("ess", ratio, valid)


def weight_metrics(metrics: Metrics, weights: torch.Tensor, mask: torch.Tensor) -> None:
    """is_mean/std/min/max and is_ess of the applied weights over the loss mask (never padding)."""
    metrics.mean("is_mean", weights, mask)
    metrics.std("is_std", weights, mask)
    metrics.min("is_min", weights, mask)
    metrics.max("is_max", weights, mask)
    metrics.ess("is_ess", weights, mask)


def split_metrics(out: Correction, config: CorrectionConfig | dict[str, Any] | str | None = None,
                  advantages: torch.Tensor | None = None) -> Metrics:
    """Metrics the field added in 2026 (issue #46), from a ``correct`` result (its valid and
    surviving masks, its clamped log ρ). ``masked`` = valid tokens the rejection removed, ``kept``
    = the survivors:

    * ``kl_k3_kept`` / ``kl_k3_masked``: mean k3 = ρ − 1 − log ρ over the kept / masked tokens —
      prime-rl's mismatch KL split by its mask (``mismatch_kl/unmasked``, ``/masked``): how far the
      tokens the loss still trains on are from μ, apart from the ones it dropped;
    * ``masked_advantage_positive`` / ``_negative``: of the masked tokens, the share with A > 0 /
      A < 0 (prime-rl #2481, on its DPPO mask): whether the mask mostly withholds pushes up or
      pushes down (needs ``advantages``);
    * ``seq_fraction_above_high`` / ``_below_low`` (a weight with a fixed bound): the share of rows
      whose *raw* weight — the row's mean ρ_t over its kept tokens at token level, the row ratio at
      sequence / geometric level — is above ``weight.high`` / below ``weight.low`` (verl #6806,
      ``rollout_is_seq_fraction_high/low`` in verl 0.9.1 ``rollout_corr_helper.py``: read from the
      truncated weights, whose row mean can never exceed the cap, the high fraction was always 0).

    Every entry is a mean or a ratio of counts, so ``merge`` over micro-batches and ranks gives the
    whole batch's value; an empty selection reports NaN (no data)."""
    cfg = as_correction_config(config)
    valid, kept = out.valid_mask.bool(), out.mask.bool()
    masked = valid & ~kept
    clamp = ops.effective_log_clamp(cfg.log_clamp)
    metrics = Metrics()
    k3 = ops.k3(out.log_ratio, clamp)
    metrics.mean("kl_k3_kept", k3, kept)
    metrics.mean("kl_k3_masked", k3, masked)
    if advantages is not None:
        a = advantages.float()
        metrics.ratio("masked_advantage_positive", (masked & (a > 0)).sum(), masked.sum())
        metrics.ratio("masked_advantage_negative", (masked & (a < 0)).sum(), masked.sum())
    w = cfg.weight
    if w is None or cfg.anchor == "rollout" or w.level == "segment":
        return metrics
    rows = kept.any(dim=-1)
    if w.level == "token":
        raw = ops.masked_mean(ops.safe_exp(out.log_ratio, clamp), kept, dim=-1)  # [B] mean raw ρ_t
    else:
        raw = ops.safe_exp(ops.row_log_ratio(out.log_ratio, kept, geometric=w.level == "geometric"), clamp)
    for key, bound, beyond in (("seq_fraction_above_high", w.high, lambda x, b: x > b),
                               ("seq_fraction_below_low", w.low, lambda x, b: x < b)):
        if isinstance(bound, (int, float)):  # a data-chosen bound is resolved by resolve_thresholds first
            metrics.mean(key, beyond(raw, bound), rows)
    return metrics


# =========================================================================== correct
def as_correction_config(config: CorrectionConfig | dict[str, Any] | str | None) -> CorrectionConfig:
    """Accept a config, a dict of its fields, a preset name, or None (measure only)."""
    if config is None:
        return CorrectionConfig()
    if isinstance(config, CorrectionConfig):
        return config
    if isinstance(config, str):
        return CorrectionConfig.from_preset(config)
    return CorrectionConfig.from_dict(config)


def correct(
    old_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: CorrectionConfig | dict[str, Any] | str | None = None,
    logprobs: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    *,
    ref_logprobs: torch.Tensor | None = None,
) -> Correction:
    """Measure the mismatch and compute IS weights and the loss mask (docs/specification.md §2–§4, §6–§7).

    Args:
        old_logprobs:     [B, T] log π_old(y_t), no grad (may be None for anchors rollout/current).
        rollout_logprobs: [B, T] log μ(y_t) reported by the inference engine.
        mask:             [B, T] 1 for tokens that count (bool or 0/1).
        config:           CorrectionConfig, its dict, a preset name, or None (measure only).
        logprobs:         [B, T] log π_θ(y_t) of this forward (detached here); needed by
                          anchors rollout/current and by the opsm rule.
        advantages:       [B, T] A_t; needed by the opsm rule.
        ref_logprobs:     [B, T] reference log-probs of a KL term, if any: checked like π_θ
                          (a non-finite value follows ``nonfinite``; it has no neutral value).

    Non-finite values (``nonfinite``, docs/specification.md §6): ``neutral`` replaces a bad value of a ratio
    input (the anchor's trainer side, or log μ) by the other side's value — log ρ_t = 0 — and
    PPO's π_old of that token is the replaced value, so nothing non-finite reaches any output;
    the token stays in every statistic (kl_k1, ppl_train, ppl_rollout, ..., with its
    replaced value) and in the loss. Both sides bad, or a bad π_θ / A / ref: the token is masked.

    Returns:
        Correction(weights, mask, metrics, log_ratio, valid_mask). Under anchor 'rollout' the
        weights are the mask (PPO's ratio carries the correction).

    Raises:
        ValueError: invalid inputs (shape, dtype, mask, positive log-probs, no valid token),
            non-finite values under ``nonfinite: error``, or a missing tensor a rule needs.
    """
    cfg = as_correction_config(config)
    if rollout_logprobs is None:
        raise ValueError(
            "correct() needs rollout_logprobs (log μ reported by the inference engine): the mismatch is "
            "measured against it. Request log-probs from the engine (vLLM: SamplingParams(logprobs=0))"
        )
    input_mask = validate_inputs(
        mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, logprobs=logprobs, advantages=advantages
    )
    trainer_name, trainer = trainer_side(cfg.anchor, old_logprobs, logprobs)
    current = None if logprobs is None else logprobs.detach()
    clean = sanitize(
        input_mask,
        cfg.nonfinite,
        ratio_inputs={trainer_name: trainer, "rollout_logprobs": rollout_logprobs},
        # π_θ, π_old (where it is not the ratio's side) and A feed the loss, which has no neutral value
        loss_inputs={
            "logprobs": current,
            "old_logprobs": old_logprobs if cfg.anchor == "current" else None,
            "advantages": advantages,
            "ref_logprobs": ref_logprobs,
        },
    )
    valid = clean.valid
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    trainer_f, rollout_f = trainer.float(), rollout_logprobs.float()
    if cfg.nonfinite == "neutral":  # the bad side takes the other side's value: log ρ = 0
        bad_t, bad_m = clean.bad[trainer_name], clean.bad["rollout_logprobs"]
        trainer_f, rollout_f = torch.where(bad_t, rollout_f, trainer_f), torch.where(bad_m, trainer_f, rollout_f)
    trainer = torch.where(valid, trainer_f, zero)
    rollout = torch.where(valid, rollout_f, zero)
    clamp = ops.effective_log_clamp(cfg.log_clamp)
    log_ratio = (trainer - rollout).clamp(-clamp, clamp)  # [B, T], 0 off valid and on neutral tokens

    metrics = Metrics()
    metrics.sum("nonfinite_tokens", clean.count)
    metrics.sum("valid_tokens", valid.sum())
    mismatch_metrics(metrics, trainer, rollout, log_ratio, valid, clamp)

    batch = RuleInputs(
        log_ratio=log_ratio,
        trainer=trainer,
        rollout=rollout,
        current=None if current is None else torch.where(valid, current.float(), zero),
        advantages=None if advantages is None else torch.where(valid, advantages.float(), zero),
        clamp=clamp,
    )
    after: list[torch.Tensor] = []
    row_rules: list[torch.Tensor] = []
    surviving = apply_rejection(cfg, batch, valid, input_mask, metrics, after, row_rules)
    row_mask = valid
    for decision in row_rules:
        row_mask = row_mask & decision
    # after[0] is valid (fixed), after[-1] the surviving mask (renormalize), after[n] the count after n rules
    counted = after[{"fixed": 0, "renormalize": -1}.get(cfg.denominator, cfg.denominator)]
    metrics.ratio("masked_fraction", (input_mask & ~surviving).sum(), input_mask.sum())
    metrics.ratio("masked_fraction_seq", (input_mask & ~surviving).any(dim=-1).sum(), input_mask.any(dim=-1).sum())

    weight_mean = 1.0
    if cfg.weight is None or cfg.anchor == "rollout":
        weights = surviving.float()
    else:
        weights = compute_weights(cfg.weight, log_ratio, surviving, clamp, metrics, input_mask)
        if cfg.weight.normalize:
            level = "token" if cfg.weight.level == "segment" else cfg.weight.level
            weight_mean = weight_normalizer(weights, surviving, level, cfg.weight.normalize_mean)
            weights = weights if weight_mean == 1.0 else weights / weight_mean
    weight_metrics(metrics, weights, surviving)
    return Correction(
        weights=weights.detach(),
        mask=surviving.float(),
        metrics=metrics,
        log_ratio=log_ratio,
        valid_mask=valid.float(),
        old_logprobs={"old": trainer, "rollout": rollout}.get(cfg.anchor),
        count_mask=counted.float(),
        row_mask=row_mask,
        weight_mean=weight_mean,
    )
