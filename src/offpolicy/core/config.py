"""Typed configuration: every option, its default and its rule live here (docs/specification.md §8).

``CorrectionConfig`` says how the rollout–training mismatch is measured and corrected;
``LossConfig`` says which policy loss consumes it. Both load from a dict, a YAML file or a
preset name, reject unknown keys (with a "did you mean" hint) and reject invalid combinations
with one message that names the field, the value and the fix.
"""

from __future__ import annotations

import contextvars
import difflib
import math
import numbers
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from offpolicy.core import preset_data
from offpolicy.core.errors import ConfigError


_NESTING: contextvars.ContextVar[int] = contextvars.ContextVar("offpolicy_config_nesting", default=0)




def _format_validation_error(model: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in (model, *e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown key {e['loc'][-1]!r}"
        elif e["type"] in ("literal_error", "union_tag_invalid"):
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"{path}: {msg}")
    return "\n".join(lines)


class _Strict(BaseModel):
    """Base: frozen, unknown keys rejected with the allowed keys and a close match."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = list(cls.model_fields)
            unknown = [k for k in data if k not in allowed]
            if unknown:
                hints = []
                for key in unknown:
                    close = difflib.get_close_matches(str(key), allowed, n=1)
                    hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
                raise ValueError(f"unknown key {', '.join(hints)}; allowed keys: {', '.join(allowed)}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_finite(cls, data: Any) -> Any:
        # NaN passes every `ge`/`le` comparison-free path and ±inf every one-sided bound: a k2
        # `high: NaN` rejected every token, a truncate `low: inf` made the loss NaN (issue #27
        # items 6–7). No option of this package means anything at ±inf/NaN; open is null.
        if isinstance(data, dict):
            for key, value in data.items():
                if isinstance(value, str):
                    try:
                        value = float(value)  # pydantic's lax float reads "nan" / "inf" strings
                    except ValueError:
                        continue
                if isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isfinite(value):
                    raise ValueError(f"{key}: got {value}, which is not a finite number; every number here must be "
                                     "finite (a bound left open is written null, or left out)")
        return data

    def __init__(self, **data: Any) -> None:
        # Only the outermost model turns pydantic's errors into one ConfigError; nested models
        # (validated through this same __init__) let them through so every path stays precise.
        token = _NESTING.set(_NESTING.get() + 1)
        try:
            super().__init__(**data)
        except ValidationError as err:
            if _NESTING.get() > 1:
                raise
            raise ConfigError(_format_validation_error(type(self).__name__, err)) from None
        finally:
            _NESTING.reset(token)


# --------------------------------------------------------------------------- data-chosen bounds (issue #12)
class EssBound(_Strict):
    """A truncation cap chosen from the batch (issue #12 item 2): the LARGEST c whose truncated
    weights min(w_i, c) keep the normalised effective sample size

        ESS(c) = (Σ_i min(w_i, c))² / (n · Σ_i min(w_i, c)²)  ≥  target

    over the n weight units of the call (valid tokens, or non-empty rows / segments). ESS(c)
    is non-increasing in c (dESS/dc ∝ Σ_{w_i<c} w_i (w_i − c) ≤ 0), so the cap is found exactly
    by sorting: the least bias (largest cap) inside the variance budget. If the untruncated
    weights already reach the target, c = max w (nothing is cut). Only for ``weight.high`` with
    mode ``truncate``."""

    rule: Literal["ess"] = Field(description="ess: the largest cap whose truncated weights keep the normalised "
                                 "effective sample size ≥ target")
    target: float = Field(gt=0, le=1, description="normalised ESS the truncated weights must keep, in (0, 1]")


class QuantileBound(_Strict):
    """A bound at an order statistic of the call's ratios (issue #12 item 2): with the n unit
    ratios sorted, v_(1) ≤ … ≤ v_(n), an upper bound is v_(⌈q·n⌉) and a lower bound
    v_(⌊q·n⌋+1) (indices clamped to [1, n]) — so an upper band removes at most (1 − q)·n units
    and a lower band at most q·n (fewer only on ties). No interpolation: the bound is one of
    the ratios, so the comparison with it is exact in fp32."""

    rule: Literal["quantile"] = Field(description="quantile: the bound is an order statistic of the call's ratios")
    q: float = Field(ge=0, le=1, description="quantile level in [0, 1]")


AdaptiveBound = Annotated[Union[EssBound, QuantileBound], Field(discriminator="rule")]


def is_adaptive(bound: Any) -> bool:
    """Whether ``bound`` is chosen from the data (an EssBound / QuantileBound) rather than a number."""
    return isinstance(bound, (EssBound, QuantileBound))


def _check_band(low: Any, high: Any, what: str) -> None:
    if isinstance(low, QuantileBound) and isinstance(high, QuantileBound) and low.q > high.q:
        raise ValueError(f"{what}: low quantile q={low.q} is above high quantile q={high.q}; swap them")
    if is_adaptive(low) or is_adaptive(high):
        return
    if low is not None and high is not None and low > high:
        raise ValueError(f"{what}: low={low} is above high={high}; swap them")


LowBound = Union[Annotated[float, Field(ge=0)], AdaptiveBound, None]
HighBound = Union[Annotated[float, Field(gt=0)], AdaptiveBound, None]
_BOUND_KINDS = {"ess": EssBound, "quantile": QuantileBound}


def _parse_bounds(data: Any, what: str) -> Any:
    """Turn the ``low``/``high`` of a band into a number or an adaptive bound before pydantic's
    union sees them, so that a mistake gives one message naming the field (not one per branch)."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for side, positive in (("low", False), ("high", True)):
        value = data.get(side)
        if value is None or isinstance(value, (EssBound, QuantileBound)):
            continue
        if isinstance(value, dict):
            kind = value.get("rule")
            if kind not in _BOUND_KINDS:
                raise ValueError(
                    f"{what}.{side}: a data-chosen bound needs rule 'ess' ({{rule: ess, target: 0.9}}) or 'quantile' "
                    f"({{rule: quantile, q: 0.99}}); got rule={kind!r}"
                )
            try:
                data[side] = _BOUND_KINDS[kind](**value)
            except ValidationError as err:
                raise ValueError(_format_validation_error(f"{what}.{side}", err) + f" (got {value})") from None
            continue
        if isinstance(value, str):  # YAML 1.1 reads 1.0e4 as a string; pydantic's lax float took it before
            try:
                value = data[side] = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{what}.{side}: expected a number, a {{rule: ...}} mapping or null; got {value!r}")
        if value < 0 or (positive and value == 0):
            need = "> 0" if positive else "≥ 0"
            raise ValueError(f"{what}.{side}: a ratio bound must be {need}; got {value}")
    return data


# --------------------------------------------------------------------------- weighting (§3)
class WeightConfig(_Strict):
    """Soft correction w multiplying the per-token loss (docs/specification.md §3).

    token:     w_t = f(ρ_t)
    sequence:  w   = f(Π_t ρ_t)               (broadcast to the row)
    geometric: w   = f(exp(mean_t log ρ_t))   (broadcast to the row)
    segment:   w   = f(exp(mean_{t∈s} log ρ_t)) broadcast to each segment s, a maximal run of
               consecutive tokens with mask = 1 (one assistant turn of a multi-turn rollout whose
               tool/environment tokens are masked; ROLL ``weight_type: segment``)
    truncate:  f(ρ) = clamp(ρ, low, high)     (TIS; a None bound is open)
    mask:      f(ρ) = ρ · 1[low ≤ ρ ≤ high]   (IcePop; the value is kept inside the band)

    A bound may be chosen from the call's data: ``{rule: ess, target}`` (upper cap of truncate
    only) or ``{rule: quantile, q}`` — see ``EssBound`` / ``QuantileBound``.
    """

    level: Literal["token", "sequence", "geometric", "segment"] = Field(description="granularity of the ratio")
    mode: Literal["truncate", "mask"] = Field(description="truncate (TIS) or mask (IcePop)")
    low: LowBound = Field(None, description="lower bound on the ratio; a number, {rule: quantile, q}, or None = open")
    high: HighBound = Field(None, description="upper bound on the ratio; a number, {rule: ess, target}, "
                            "{rule: quantile, q}, or None = open")
    normalize: bool = Field(False, description="divide by the batch mean weight (across DP ranks)")
    normalize_mean: float | None = Field(
        None, gt=0, description="the mean weight normalize divides by, fixed for a whole optimizer step by "
        "offpolicy.resolve_thresholds (so micro-batches divide by the step's mean); None = the call's own mean")

    @model_validator(mode="before")
    @classmethod
    def _bounds(cls, data: Any) -> Any:
        return _parse_bounds(data, "weight")

    @model_validator(mode="after")
    def _band_is_ordered(self) -> WeightConfig:
        _check_band(self.low, self.high, "weight")
        if self.mode == "mask" and self.low is None and self.high is None:
            raise ValueError(
                "weight: mode 'mask' needs a band (low and/or high); for the raw ratio use "
                "mode 'truncate' with no bounds"
            )
        if isinstance(self.low, EssBound):
            raise ValueError(
                f"weight.low: {{rule: ess, target: {self.low.target}}} chooses an upper cap; put it under "
                "weight.high, or use {rule: quantile, q} for a lower bound"
            )
        if self.normalize_mean is not None and not self.normalize:
            raise ValueError(f"weight.normalize_mean={self.normalize_mean} is the mean that normalize divides by, "
                             "but normalize is false; set normalize: true or drop normalize_mean")
        if isinstance(self.high, EssBound) and self.mode != "truncate":
            raise ValueError(
                f"weight.high: {{rule: ess}} chooses a truncation cap, so it needs mode 'truncate' (got mode "
                f"'{self.mode}'); for a data-chosen mask band use {{rule: quantile, q}}"
            )
        return self

    @property
    def adaptive(self) -> bool:
        return is_adaptive(self.low) or is_adaptive(self.high)


# --------------------------------------------------------------------------- rejection (§4)
class RatioRule(_Strict):
    """Drop tokens/rows whose ratio leaves [low, high] (IcePop-as-mask, Seq-MIS, Geo-RS, veto)."""

    stat: Literal["ratio"] = Field(description="ratio: a band on the importance ratio ρ = π_train/μ")
    level: Literal["token", "sequence", "geometric", "any_token"] = Field(
        description="token: drop a token whose ρ_t leaves the band (IcePop as a mask); sequence: drop a row by "
        "Π_t ρ_t (Seq-MIS); geometric: by exp(mean_t log ρ_t) (Geo-RS); any_token: drop a row if any of its "
        "tokens' ρ_t leaves the band (the veto)")
    low: LowBound = Field(None, description="a number, {rule: quantile, q} (of the token ratios for token/any_token, "
                          "of the row ratios for sequence/geometric), or None = open")
    high: HighBound = Field(None, description="as low")

    @model_validator(mode="before")
    @classmethod
    def _bounds(cls, data: Any) -> Any:
        return _parse_bounds(data, "reject rule 'ratio'")

    @model_validator(mode="after")
    def _has_a_band(self) -> RatioRule:
        if self.low is None and self.high is None:
            raise ValueError("reject rule 'ratio' needs low and/or high")
        for side in ("low", "high"):
            if isinstance(getattr(self, side), EssBound):
                raise ValueError(
                    f"reject rule 'ratio': {side}={{rule: ess}} is a truncation cap for weight.high, not a rejection "
                    "band; use {rule: quantile, q} here"
                )
        _check_band(self.low, self.high, "reject rule 'ratio'")
        return self

    @property
    def adaptive(self) -> bool:
        return is_adaptive(self.low) or is_adaptive(self.high)


class DivergenceRule(_Strict):
    """Bound a KL-estimator statistic (verl ``rollout_rs``): k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ−1−log ρ.

    A row-level statistic is the sum / mean / max of the per-token values over valid tokens.
    k1 takes a band; k2 and k3 are ≥ 0 and take only an upper bound; seq_max is undefined for k1.

    ``direction`` (issue #26) says which divergence the per-token estimators are written for,
    with y ~ μ and log ρ = log π_train − log μ:

        mu_pi (verl, default)  KL(μ ‖ π_train):  k1 = −log ρ,  k2 = ½(log ρ)²,  k3 = ρ − 1 − log ρ
        pi_mu (AReaL)          KL(π_train ‖ μ):  k1 = +log ρ,  k2 = ½(log ρ)²,  k3 = 1/ρ − 1 + log ρ

    (AReaL 1.0.4 calls ``KLEstimator._compute_approx_kl(log_probs=π_prox, log_probs_base=μ)``,
    areal/utils/data.py.) Under y ~ μ, mu_pi's k1 and k3 are unbiased for their KL; pi_mu's are
    KL(π ‖ μ)'s estimators written as if y ~ π. k2 is the same in both directions.
    """

    stat: Literal["k1", "k2", "k3"] = Field(
        description="the KL estimator bounded, per token: k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ "
        "(direction mu_pi)")
    level: Literal["token", "seq_sum", "seq_mean", "seq_max"] = Field(
        description="token: each token's value; seq_sum / seq_mean / seq_max: the row's sum / mean / max over its "
        "valid tokens, the row dropped whole (seq_max: not for k1)")
    low: float | None = Field(None, description="k1 only: drop below this; None = open")
    high: float | None = Field(None, description="drop above this (required for k2 and k3, which are ≥ 0); "
                               "None = open (k1 only)")
    direction: Literal["mu_pi", "pi_mu"] = Field(
        "mu_pi", description="mu_pi: estimators of KL(μ‖π_train), k1 = −log ρ, k3 = ρ − 1 − log ρ (verl); pi_mu: "
        "of KL(π_train‖μ), k1 = log ρ, k3 = 1/ρ − 1 + log ρ (AReaL)")

    @model_validator(mode="after")
    def _no_lower_bound_on_a_divergence(self) -> DivergenceRule:
        # issue #26 item 2: AReaL accepts `lower` on kl_k2 / kl_k3; as a correction it is not meaningful
        if self.stat != "k1" and self.low is not None:
            raise ValueError(
                f"reject rule '{self.stat}' takes only an upper bound; got low={self.low}. {self.stat} ≥ 0 is 0 "
                "exactly where π_train = μ, so a lower bound drops the on-policy tokens (the only ones that need no "
                "correction) and keeps the mismatched ones. Remove low; for a two-sided band use stat k1 (the signed "
                "log-ratio) or stat ratio"
            )
        return self

    @model_validator(mode="after")
    def _bounds_fit_the_statistic(self) -> DivergenceRule:
        if self.stat == "k1":
            if self.level == "seq_max":
                raise ValueError("reject rule 'k1': level 'seq_max' is not defined for k1 (it is signed); use seq_sum or seq_mean")
            if self.low is None and self.high is None:
                raise ValueError("reject rule 'k1' needs low and/or high")
            _check_band(self.low, self.high, "reject rule 'k1'")
        else:
            if self.low is not None:
                raise ValueError(
                    f"reject rule '{self.stat}' takes only an upper bound ({self.stat} ≥ 0); got low={self.low}. Remove low"
                )
            if self.high is None or self.high < 0:
                raise ValueError(f"reject rule '{self.stat}' needs high ≥ 0; got high={self.high}")
        return self


class OPSMRule(_Strict):
    """DeepSeek-V3.2 off-policy sequence mask: drop a row if mean_t A < 0 and
    mean_t(log μ − sg(log π_θ)) > delta."""

    stat: Literal["opsm"] = Field(description="opsm: DeepSeek-V3.2's off-policy sequence mask")
    level: Literal["sequence"] = Field("sequence", description="sequence, the only level: a row is dropped whole")
    delta: float = Field(description="threshold on the row's mean log μ − log π_θ")


class BinaryKLRule(_Strict):
    """Binary KL between μ and π_train on the sampled token, KL(Bern(μ(y_t)) ‖ Bern(π_train(y_t))):

        p = clamp(e^{log μ}, 1e-6, 1−1e-6), q = clamp(e^{log π_train}, 1e-6, 1−1e-6)
        bkl_t = max(0, p (log p − log q) + (1−p) (log(1−p) − log(1−q)))

    computed in fp32 and clamped at zero: the exact value is ≥ 0, but for p ≈ q the two terms
    cancel and fp32 rounding leaves a small negative number (OpenRLHF #1354 rejected valid
    samples on such values). π_train is the anchor's trainer side (π_old under anchor old,
    sg(π_θ) under rollout / current).

    level ``seq_mean`` (OpenRLHF 0.11 FlashREINFORCE gating): drop a row unless mean_t bkl_t ≤ high.
    level ``token`` (OpenRLHF 0.11.2 ``is_correction_level=token, gating=binary_kl``; SkyRL 0.4.0
    DPPO ``dppo_type=binary_kl``; AReaL v2 KPop): drop a token with bkl_t > high.
    ``by_advantage`` (token level only; SkyRL DPPO Binary-KL, ``dppo_policy_loss`` in
    skyrl/backends/skyrl_train/utils/ppo_utils.py): only a token pushed further the way it already
    moved is dropped — A_t > 0 with π_train > μ and bkl_t > high, or A_t < 0 with π_train < μ and
    bkl_t > ``high_negative`` (SkyRL's ``delta_low``; default ``high``). Tokens with A_t = 0 stay.

    ``direction``: ``mu_pi`` KL(Bern(μ) ‖ Bern(π_train)) (OpenRLHF, SkyRL; the default),
    ``pi_mu`` KL(Bern(π_train) ‖ Bern(μ)), ``both`` the larger of the two — AReaL's KPop
    (areal-project/AReaL #1405, ``areal/utils/functional/functional.py``: a token is kept iff
    both directions are below ``kpop_phi``; AReaL's test is strict, ours ≤ like every bound).
    """

    stat: Literal["binary_kl"] = Field(description="binary_kl: the Bernoulli KL between μ and π_train of the "
                                       "sampled token")
    level: Literal["seq_mean", "token"] = Field(
        "seq_mean", description="seq_mean: drop a row unless its mean bkl ≤ high (OpenRLHF); token: drop a token "
        "whose bkl > high")
    high: float = Field(ge=0, description="bound on bkl (token) or on its row mean (seq_mean)")
    by_advantage: bool = Field(False, description="token level: drop only A>0 tokens whose probability rose and "
                               "A<0 tokens whose probability fell (SkyRL DPPO Binary-KL; needs advantages)")
    high_negative: float | None = Field(None, ge=0, description="with by_advantage: the bound for A<0 tokens "
                                        "(SkyRL delta_low); None = high")
    direction: Literal["mu_pi", "pi_mu", "both"] = Field(
        "mu_pi", description="mu_pi: KL(Bern(μ)‖Bern(π_train)) (OpenRLHF, SkyRL); pi_mu: the reverse; both: the "
        "larger of the two (AReaL KPop)")

    @model_validator(mode="after")
    def _advantage_split_is_per_token(self) -> BinaryKLRule:
        if self.level != "token" and (self.by_advantage or self.high_negative is not None):
            raise ValueError(
                f"reject rule 'binary_kl': by_advantage / high_negative need level 'token' (got level "
                f"'{self.level}'); a row mean has no single advantage sign. Set level: token"
            )
        if self.high_negative is not None and not self.by_advantage:
            raise ValueError(
                f"reject rule 'binary_kl': high_negative={self.high_negative} is the bound for A<0 tokens and "
                "applies only with by_advantage: true; set by_advantage: true or remove high_negative"
            )
        return self


class M2Rule(_Strict):
    """M2PO (AReaL ``m2_threshold``, areal/trainer/ppo/actor.py ``_apply_m2po_masking``, 1.0.4):
    drop the tokens with the largest m2_t = (log ρ_t)² until the second moment of the rest is
    below ``high``. With the n incoming tokens' m2 sorted descending, s_1 ≥ … ≥ s_n, and
    k = min{i ≥ 0 : mean(s_{i+1..n}) < high} (k = n − 1 if there is none), the tokens with
    m2 ≥ s_k are dropped (none if k = 0). Ties at s_k are dropped together — AReaL's unstable
    sort drops an arbitrary subset of them — so the kept second moment is always < high, and at
    least one token (the smallest m2) survives. A batch statistic: computed per call (one
    micro-batch) like AReaL, or over a whole step with ``offpolicy.resolve_thresholds``."""

    stat: Literal["m2"] = Field(description="m2: M2PO, drop the tokens of largest (log ρ)² until the rest's mean "
                                "is below high")
    level: Literal["token"] = Field("token", description="token, the only level")
    high: float = Field(gt=0, description="bound on the kept tokens' mean (log ρ)² (AReaL m2_threshold)")


class MultErrorRule(_Strict):
    """NeMo-RL ``grpo.seq_logprob_error_threshold`` (nemo_rl/algorithms/grpo.py
    ``compute_and_apply_seq_logprob_error_masking``): the multiplicative probability error of a
    row, mean_t exp(|log ρ_t|) = mean_t max(ρ_t, 1/ρ_t) ≥ 1 over its valid tokens; drop the row
    unless it is ≤ ``high``."""

    stat: Literal["mult_error"] = Field(description="mult_error: a row's multiplicative probability error "
                                        "mean_t exp(|log ρ_t|) (NeMo-RL)")
    level: Literal["seq_mean"] = Field("seq_mean", description="seq_mean, the only level: a row is dropped whole")
    high: float = Field(ge=1, description="bound on mean_t exp(|log ρ_t|) (≥ 1; NeMo-RL recipes use 2)")


class ProbDiffRule(_Strict):
    """A trust region in probability space (prime-rl DPPO-Binary-TV / IPO masks,
    src/prime_rl/trainer/rl/loss.py): with d_t = π_train(y_t) − μ(y_t) (π_train the anchor's
    trainer side; sg(π_θ) under anchors rollout/current), drop the token if d_t > high or
    d_t < −low. ``by_advantage``: high applies only where A_t > 0 and low only where A_t ≤ 0
    (prime-rl's default loss: a token whose probability already rose too far is not pushed up
    further, one that fell too far is not pushed down)."""

    stat: Literal["prob_diff"] = Field(description="prob_diff: a trust region on d_t = π_train(y_t) − μ(y_t) "
                                       "(prime-rl)")
    level: Literal["token"] = Field("token", description="token, the only level")
    low: float | None = Field(None, ge=0, description="drop d_t < −low; None = open")
    high: float | None = Field(None, ge=0, description="drop d_t > high; None = open")
    by_advantage: bool = Field(False, description="high only where A > 0, low only where A ≤ 0 (needs advantages)")

    @model_validator(mode="after")
    def _has_a_bound(self) -> ProbDiffRule:
        if self.low is None and self.high is None:
            raise ValueError("reject rule 'prob_diff' needs low and/or high (bounds on |π − μ|, e.g. 0.2)")
        return self


RejectRule = Annotated[
    Union[RatioRule, DivergenceRule, OPSMRule, BinaryKLRule, M2Rule, MultErrorRule, ProbDiffRule],
    Field(discriminator="stat"),
]


def rule_name(index: int, rule: Any) -> str:
    """Stable metric namespace of a rule, e.g. ``0_ratio_token``."""
    return f"{index}_{rule.stat}_{rule.level}"


# --------------------------------------------------------------------------- correction
class _Loadable(_Strict):
    """dict / YAML loading shared by the top-level configs; ``_section`` names the YAML key."""

    _section: ClassVar[str]

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        if not isinstance(data, dict):
            raise ConfigError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path):
        """Load from a YAML file holding the fields, or holding them under the ``_section`` key
        (``correction:`` / ``loss:``)."""
        data = _read_yaml(path)
        return cls.from_dict(data.get(cls._section, data))


class CorrectionConfig(_Loadable):
    """How the mismatch between the sampler μ and the trainer is corrected (docs/specification.md §2–§6).

    Order of application (fixed): sanitize → rejection rules in listed order → weights on the
    surviving mask → normalize.
    """

    anchor: Literal["old", "rollout", "current"] = Field(
        "old",
        description="old: log ρ = log π_old − log μ (decoupled); rollout: bypass, PPO's ratio is π_θ/μ; "
        "current: log ρ = sg(log π_θ) − log μ",
    )
    weight: WeightConfig | None = Field(None, description="soft correction; None = no weighting")
    reject: list[RejectRule] = Field(default_factory=list, description="hard rules, all must pass")
    reject_mode: Literal["independent", "sequential"] = Field(
        "independent", description="independent: each rule sees the incoming mask (verl); sequential: the mask left by earlier rules (SkyRL)"
    )
    denominator: Literal["fixed", "renormalize"] | int = Field(
        "renormalize", description="fixed: original valid-token count; renormalize: surviving count; an integer n: "
        "the tokens left after the first n reject rules (AReaL: the tokens M2PO keeps, before rejection sampling)"
    )
    log_clamp: float | None = Field(20.0, gt=0, description="clamp log ρ to [−L, L] before exp (L ≤ 60); None = 60, the largest bound whose weights cannot overflow the loss")
    nonfinite: Literal["error", "mask_token", "mask_sequence", "neutral"] = Field(
        "error", description="what to do with NaN/inf log-probs on valid tokens"
    )
    kl_is_weight: bool = Field(False, description="multiply the KL term by the same detached weights")
    _section: ClassVar[str] = "correction"

    @model_validator(mode="after")
    def _bypass_has_no_weight(self) -> CorrectionConfig:
        if self.anchor == "rollout" and self.weight is not None:
            raise ValueError(
                "anchor 'rollout' (bypass) makes PPO's own ratio π_θ/μ, so a separate IS weight would "
                "count the mismatch twice. Remove `weight`, or use anchor 'current' with kind reinforce"
            )
        if self.kl_is_weight and self.weight is None:
            raise ValueError("kl_is_weight: true needs a `weight` to apply to the KL term")
        return self

    @model_validator(mode="after")
    def _count_after_rules(self) -> CorrectionConfig:
        """An integer denominator n counts the tokens left after the first n rules: 0 is ``fixed``
        and len(reject) is ``renormalize``, written as those names so that every rung sees one
        spelling; only a count between two rules stays a number."""
        n = self.denominator
        if isinstance(n, bool) or not isinstance(n, int):
            return self
        if not 0 <= n <= len(self.reject):
            raise ValueError(f"denominator {n}: an integer counts the tokens left after the first n reject rules, so it "
                             f"must lie in 0..{len(self.reject)} (there are {len(self.reject)} rules); or use 'fixed' / "
                             "'renormalize'")
        if n in (0, len(self.reject)):
            object.__setattr__(self, "denominator", "fixed" if n == 0 else "renormalize")
        return self

    @classmethod
    def from_preset(cls, name: str) -> CorrectionConfig:
        """The correction of a preset, e.g. ``verl:decoupled_token_is`` (see ``offpolicy.core.presets``)."""
        preset = preset_data.get(name)
        try:
            return cls.from_dict(dict(preset.correction))
        except ConfigError as err:
            raise ConfigError(f"preset {name!r}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_defaults=True)

    @property
    def data_dependent(self) -> bool:
        """Whether a bound is chosen from the call's data (an ESS or quantile bound, an m2 rule):
        then the result depends on how the batch is split into calls (see ``resolve_thresholds``)."""
        return (self.weight is not None and self.weight.adaptive) or any(
            isinstance(r, M2Rule) or getattr(r, "adaptive", False) for r in self.reject
        )

    @property
    def step_dependent(self) -> bool:
        """Whether a call's result depends on the rest of the step it belongs to: a data-chosen
        bound (``data_dependent``), or ``weight.normalize`` without a step's mean fixed in
        ``normalize_mean`` — what ``resolve_thresholds`` fixes once per step."""
        open_mean = self.weight is not None and self.weight.normalize and self.weight.normalize_mean is None
        return self.data_dependent or (open_mean and self.anchor != "rollout")


# --------------------------------------------------------------------------- loss
_CLIP_DEFAULTS: dict[str, tuple[float | None, float | None]] = {
    "ppo": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "cispo": (None, 0.2),  # ε_low off: MiniMax-M1 bounds the IS weight only from above
    "sapo": (None, None),
    "reinforce": (None, None),
}


# options that belong to the loss kind: a preset's values do not carry over to another kind (LossConfig.preset_fields)
KIND_OPTIONS = ("clip_low", "clip_high", "dual_clip", "gspo_form", "sapo_level", "sapo_tau_pos", "sapo_tau_neg")
MERGED = ("correction", "weight")  # nested sections that overrides merge into key by key (lists replace)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``; the sections in ``MERGED`` merge recursively when both are mappings."""
    out = dict(base)
    for key, value in over.items():
        if key in MERGED and isinstance(value, dict) and isinstance(out.get(key), dict):
            value = _merge(out[key], value)
        out[key] = value
    return out


class LossConfig(_Loadable):
    """The policy loss and its aggregation (docs/specification.md §5). Clip defaults depend on ``kind``:
    ppo 0.2/0.2, gspo 3e-4/4e-4, cispo none/0.2; sapo and reinforce take no clip."""

    kind: Literal["ppo", "gspo", "cispo", "sapo", "reinforce"] = Field(
        "ppo", description="the policy loss (docs/specification.md §5): ppo = PPO's clipped ratio; gspo = GSPO's "
        "clipped sequence ratio; cispo = the clipped ratio, detached, × A × log π_θ (MiniMax-M1); sapo = soft "
        "sigmoid gates in place of the clip; reinforce = −A·log π_θ. The clip defaults follow it: ppo 0.2/0.2, "
        "gspo 3e-4/4e-4, cispo open/0.2, none for sapo and reinforce")
    clip_low: float | None = Field(None, ge=0, description="ε_low: lower clip 1 − ε_low; None = open")
    clip_high: float | None = Field(None, ge=0, description="ε_high: upper clip 1 + ε_high; None = open")
    dual_clip: float | None = Field(None, gt=1, description="PPO dual clip c > 1 for A < 0")
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how the per-token losses become one number: token-mean = Σ ℓ / N_tokens; "
        "seq-mean-token-mean = the mean over rows of Σ_t ℓ / n_row; seq-mean-token-sum = the mean over rows of "
        "Σ_t ℓ; seq-mean-token-sum-norm = the mean over rows of Σ_t ℓ / max_len (the counts: "
        "correction.denominator)")
    max_len: int | None = Field(None, gt=0, description="seq-mean-token-sum-norm divisor; None = T")
    # a count: >= 1 (a fraction was silently clamped to 1 by the division guard, issue #9 item 9)
    global_tokens: float | None = Field(
        None, ge=1, description="agg token-mean: the token count to divide by, over every micro-batch and rank of "
        "the step (≥ 1), as offpolicy.with_global_normalizer fills it in (offpolicy train does, for its "
        "micro-batches); None = the call's own count")
    global_seqs: float | None = Field(
        None, ge=1, description="the seq-mean-* aggregations: the row count to divide by, over every micro-batch "
        "and rank of the step (≥ 1), as with_global_normalizer fills it in; None = the call's own count")
    correction: CorrectionConfig | None = Field(
        None, description="how the sampler–trainer mismatch is corrected: the anchor, soft weights and hard reject "
        "rules (docs/specification.md §2–§4); None = no correction")
    sapo_tau_pos: float = Field(1.0, gt=0, description="kind sapo: the gate's temperature τ where A > 0, "
                                "ℓ = −(4/τ)·σ(τ(r − 1))·A")
    sapo_tau_neg: float = Field(1.05, gt=0, description="kind sapo: the gate's temperature τ where A ≤ 0")
    gspo_form: Literal["token", "sequence"] = Field(
        "token", description="kind gspo: token = GSPO-token, s_t = sg(s)·π_θ/sg(π_θ) with A_t; sequence = GSPO, s with "
        "its gradient through the row mean and the row-mean advantage Ā (AReaL importance_sampling_level sequence)")
    sapo_level: Literal["token", "sequence"] = Field(
        "token", description="kind sapo: token = gates on r_t with A_t; sequence = gates on the row's "
        "s = exp(mean_t log r_t) with Ā (AReaL importance_sampling_level sequence)")
    kl_coef: float = Field(0.0, ge=0, description="β of the KL-to-reference term; 0 = off")
    kl_kind: Literal["k1", "k2", "k3", "k1+", "k2+", "k3+"] = Field("k3+", description="KL estimator (docs/specification.md §5)")
    kl_to: Literal["ref", "rollout"] = Field(
        "ref", description="the KL term's target: ref = the ref_logprobs passed in (a reference model); "
        "rollout = μ, the engine's log-probs (prime-rl's kl_tau): pass no ref_logprobs")
    kl_mask: Literal["kept", "valid", "rejected"] = Field(
        "kept", description="tokens the KL term covers: kept = those the correction keeps; valid = every "
        "valid token, rejected ones included (prime-rl kl_mask_type all); rejected = only the rejected ones "
        "(prime-rl 'masked')")
    ratio_value_cap: float | None = Field(
        None, ge=1, description="kind ppo: cap the VALUE of the ratio r = π_θ/π_old at C while keeping its gradient, "
        "r̃ = exp(min(log r, log C) + log π_θ − sg(log π_θ)), before the clip (prime-rl max_importance_ratio, 1e4 on "
        "IPO and PPO); None = no cap")
    score_centering: Literal["exact", "head"] | None = Field(
        None, description="score centering (Marek & Ryabinin, arXiv 2609.20807; docs/estimators.md): add "
        "sg(A_t)·Σ_v sg(q_v·w_v)·log p_v over the sampler's support of each token (policy_loss's support_* tensors). "
        "exact: the support is the engine's whole kept set (replayed, q and p normalised over it); head: a top-k "
        "head of the full-vocabulary distributions, the rest modelled as a tail proportional to p; None = off")
    score_centering_tail_floor: float = Field(
        1e-6, gt=0, lt=1, description="score_centering head: the tail masses 1 − Σ_head are floored at this value "
        "(SkyRL #2244's tail_floor), the sampler's as well as the trainer's; the paper and NeMo-RL floor only the "
        "trainer's (the denominator of ρ), which differs only where 1 − Σ_head q < floor, by at most "
        "max(1, hi)·floor of tail mass (docs/estimators.md#score-centering)")
    _section: ClassVar[str] = "loss"

    @model_validator(mode="before")
    @classmethod
    def _clip_defaults_follow_kind(cls, data: Any) -> Any:
        if isinstance(data, dict):
            kind = data.get("kind", "ppo")
            if kind in _CLIP_DEFAULTS:
                low, high = _CLIP_DEFAULTS[kind]
                if kind in ("sapo", "reinforce"):
                    for key in ("clip_low", "clip_high"):
                        if data.get(key) is not None:
                            raise ValueError(f"kind '{kind}' has no clip; remove {key}")
                data = {"clip_low": low, "clip_high": high, **data}
        return data

    @model_validator(mode="after")
    def _options_fit_kind(self) -> LossConfig:
        if self.dual_clip is not None and self.kind not in ("ppo", "gspo"):
            raise ValueError(f"dual_clip applies to kinds 'ppo' and 'gspo' only; got kind '{self.kind}'")
        if self.gspo_form != "token" and self.kind != "gspo":
            raise ValueError(f"gspo_form '{self.gspo_form}' applies to kind 'gspo' only; got kind '{self.kind}'")
        if self.sapo_level != "token" and self.kind != "sapo":
            raise ValueError(f"sapo_level '{self.sapo_level}' applies to kind 'sapo' only; got kind '{self.kind}'; for "
                             "a sequence ratio with a hard clip use kind gspo")
        if self.max_len is not None and self.agg != "seq-mean-token-sum-norm":
            raise ValueError(f"max_len is used only by agg 'seq-mean-token-sum-norm'; got agg '{self.agg}'")
        if self.global_seqs is not None and self.agg == "token-mean":
            raise ValueError("global_seqs normalises sequence aggregations; with agg 'token-mean' use global_tokens")
        if self.global_tokens is not None and self.agg != "token-mean":
            raise ValueError(f"global_tokens normalises agg 'token-mean'; with agg '{self.agg}' use global_seqs")
        corr = self.correction
        if corr is not None and corr.anchor == "current" and self.kind != "reinforce":
            # cispo too (issue #9, confirmed): its own weight sg(clip(π_θ/π_old)) times sg(π_θ)/μ
            # is (π_θ/π_old)²·π_old/μ — the π_θ/π_old part counted twice once π_θ moves off π_old
            raise ValueError(
                f"anchor 'current' weights by sg(π_θ)/μ, which already corrects staleness; with kind "
                f"'{self.kind}' the π_θ/π_old ratio would correct it twice. Use kind reinforce (the weight "
                f"is the whole correction), or keep kind '{self.kind}' with anchor 'old' (w = π_old/μ times "
                f"the loss's π_θ/π_old) or 'rollout' (the loss's ratio becomes π_θ/μ)"
            )
        if self.ratio_value_cap is not None and self.kind != "ppo":
            raise ValueError(f"ratio_value_cap caps PPO's ratio; got kind '{self.kind}' (for cispo bound the weight with "
                             "clip_high)")
        if self.score_centering is not None:
            if self.kind not in ("ppo", "cispo", "reinforce"):
                raise ValueError(f"score_centering is defined for kinds ppo, cispo and reinforce (a token's score "
                                 f"coefficient must not depend on the other tokens of its row); got kind '{self.kind}'")
            if corr is not None and corr.data_dependent:
                raise ValueError("score_centering evaluates the correction's bounds at every token of the support, so "
                                 "they must be numbers: fix data-chosen bounds (ess / quantile / m2) for the step with "
                                 "offpolicy.resolve_thresholds first, or use fixed bounds")
        elif self.score_centering_tail_floor != 1e-6:
            raise ValueError("score_centering_tail_floor applies only with score_centering 'head'")
        if corr is not None and corr.kl_is_weight and self.kl_coef == 0:
            raise ValueError("correction.kl_is_weight is set but kl_coef is 0: there is no KL term to weight")
        for key, default in (("kl_to", "ref"), ("kl_mask", "kept")):
            if getattr(self, key) != default and self.kl_coef == 0:
                raise ValueError(f"{key} '{getattr(self, key)}' shapes the KL term but kl_coef is 0: there is no "
                                 "KL term; set kl_coef > 0 or leave it out")
        if self.kl_mask != "kept":
            if corr is None:
                raise ValueError(f"kl_mask '{self.kl_mask}' reaches tokens a correction rejects, but there is no "
                                 "correction: every valid token is kept; leave kl_mask at 'kept'")
            if corr.kl_is_weight:
                raise ValueError(f"kl_mask '{self.kl_mask}' puts the KL term on rejected tokens, whose weight is 0: "
                                 "with correction.kl_is_weight it would vanish there; use one or the other")
            if corr.denominator != "fixed":
                # renormalize divides by the kept tokens: a KL sum over rejected ones would be counted
                # in the numerator and not in the denominator
                raise ValueError(f"kl_mask '{self.kl_mask}' adds loss on rejected tokens, so the denominator must "
                                 "count them: set correction.denominator 'fixed' (prime-rl's loss_scale is Σ "
                                 "loss_mask before masking)")
        return self

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LossConfig:
        """The loss settings documented with a preset, its correction included, with ``overrides`` on top as
        ``preset_fields`` merges them — the one path from a preset to a loss (``offpolicy train``'s
        ``preset=`` and ``loss.*`` keys take it too)."""
        data = cls.preset_fields(name, overrides)
        try:
            return cls(**data)
        except ConfigError as err:
            raise ConfigError(f"preset {name!r}: {err}") from None

    @staticmethod
    def preset_fields(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The fields of preset ``name``'s loss — its loss settings (kind, clip, aggregation, …) and its
        correction — with ``overrides`` on top, unvalidated: ``correction`` and ``correction.weight`` merge
        key by key where both are mappings (a list such as ``reject`` replaces the preset's; a
        ``CorrectionConfig`` replaces the whole correction), and a ``kind`` other than the preset's drops the
        preset's kind options (``KIND_OPTIONS``: clip, dual clip, gspo/sapo forms), so the new kind starts
        from its own defaults.

        Raises:
            ConfigError: an unknown preset name (with close matches).
        """
        preset = preset_data.get(name)
        base = {**preset.loss, "correction": dict(preset.correction)}
        overrides = overrides or {}
        if "kind" in overrides and overrides["kind"] != base.get("kind", "ppo"):
            base = {k: v for k, v in base.items() if k not in KIND_OPTIONS}
        return _merge(base, overrides)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_defaults=True)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
