"""AReaL's actor-loss settings → the offpolicy ``LossConfig`` that computes the same loss (issue #26).

AReaL 1.0.4 (areal/trainer/ppo/actor.py ``grpo_loss_fn``, areal/utils/functional/functional.py
``ppo_actor_loss_fn`` / ``apply_rejection_sampling`` / ``sapo_loss_fn``) names the policies
π_θ (``logprobs``), π_prox (``proximal_logprobs``, our π_old) and μ (``old_logprobs``, the
behaviour policy: our ``rollout_logprobs``). Call ``policy_loss(π_θ, π_prox, A, mask, μ,
config=loss_config(...))``. This module is plain data: it does not import AReaL.

The keyword defaults are ``PPOActorConfig``'s own (areal/api/cli_args.py, 1.0.4):
``use_decoupled_loss=False``, ``rejection_sampling=None``, ``m2_threshold=None``, ``eps_clip=0.2``,
``use_sapo_loss=False`` …, so passing the fields an AReaL config sets (and only those) gives that
config's loss: ``loss_config(use_sapo_loss=True)`` is AReaL's ordinary SAPO setup, decoupled PPO
needs ``use_decoupled_loss=True`` as it does in AReaL.

``m2_threshold`` with an ``action: mask`` is M2PO's rule followed by the mask's rules with
``denominator: 1``: AReaL divides by the tokens M2PO keeps, BEFORE rejection sampling drops more,
and its ``loss_mask`` (our surviving mask) leaves the rejected tokens out.

Every setting maps to a config, or raises ``ConfigError`` saying why it has no meaningful
equivalent and what to use instead (docs/areal.md lists them all):

* a lower bound on ``kl_k2`` / ``kl_k3`` (drops the on-policy tokens, keeps the mismatched ones);
* ``level: sequence, agg: max`` with a lower bound on ``ratio`` or ``kl_k1`` (a lower bound on the
  row's MAXIMUM keeps a row as soon as one token reaches it; with ``action: clamp`` the row
  weight is then neither the geometric mean nor a truncation of it);
* ``action: clamp`` with a KL metric (AReaL clamps the RATIO to the KL bounds);
* ``level: sequence, agg: sum, action: clamp, metric: ratio`` with ``lower > 1``;
* ``rejection_sampling`` or ``m2_threshold`` without ``use_decoupled_loss`` (AReaL ignores them
  there: π_prox is μ itself, it warns "Filtering will be ignored");
* ``use_sapo_loss`` with ``use_decoupled_loss`` (AReaL refuses it too).
"""

from __future__ import annotations

import math
from typing import Any

from offpolicy.core.config import LossConfig
from offpolicy.core.errors import ConfigError

_RS_DEFAULTS = {"level": "token", "action": "mask", "metric": "ratio", "agg": "mean", "upper": 5.0, "lower": None}


def _rs_fields(rejection_sampling: Any) -> dict[str, Any] | None:
    """A RejectionSamplingConfig (AReaL's dataclass) or a dict of its fields → a dict with defaults."""
    if rejection_sampling is None:
        return None
    if isinstance(rejection_sampling, dict):
        unknown = set(rejection_sampling) - set(_RS_DEFAULTS)
        if unknown:
            raise ConfigError(f"rejection_sampling: unknown key(s) {sorted(unknown)}; AReaL's keys: {', '.join(_RS_DEFAULTS)}")
        return {**_RS_DEFAULTS, **rejection_sampling}
    return {key: getattr(rejection_sampling, key) for key in _RS_DEFAULTS}


def _refuse(rs: dict[str, Any], why: str) -> ConfigError:
    setting = ", ".join(f"{k}: {rs[k]}" for k in ("level", "action", "metric", "agg", "lower", "upper"))
    return ConfigError(f"AReaL rejection_sampling {{{setting}}}: {why}")


def rejection_sampling_correction(rs: dict[str, Any]) -> dict[str, Any]:
    """The correction fields (``reject``, ``weight``) of one AReaL rejection_sampling setting.

    Raises:
        ConfigError: a setting with no meaningful equivalent (module docstring), saying why.
    """
    level, action, metric, agg = rs["level"], rs["action"], rs["metric"], rs["agg"]
    low, high = rs["lower"], rs["upper"]
    if metric == "ratio" and low == 0:
        low = None  # RejectionSamplingConfig sets lower 0.0 under action clamp; a ratio is ≥ 0 anyway
    band = {"low": low, "high": high}
    raw_token = {"level": "token", "mode": "truncate"}  # the kept tokens keep their raw ρ_t
    if metric != "ratio":
        if action == "clamp":  # RejectionSamplingConfig refuses it too; apply_rejection_sampling computes it
            raise _refuse(rs, "with a KL metric, action 'clamp' clamps the RATIO ρ_t to the KL bounds "
                          f"[{low or 0}, {high}] — a KL threshold used as a ratio cap. Use metric 'ratio' with "
                          "action 'clamp' (offpolicy: weight {mode: truncate}), or action 'mask' to reject on the KL")
        stat = metric.removeprefix("kl_")
        kl_level = "token" if level == "token" else f"seq_{agg}"
        if stat == "k1" and kl_level == "seq_max":
            if low is not None:
                raise _refuse(rs, "a lower bound on the row's maximum log ρ_t keeps a row as soon as ONE token "
                              "reaches it, so it bounds neither the row nor its worst token. Bound every token "
                              "instead: offpolicy reject {stat: ratio, level: any_token, low: e^lower, high: e^upper}")
            # max_t log ρ_t ≤ U ⇔ every ρ_t ≤ e^U
            rule = {"stat": "ratio", "level": "any_token", "high": math.exp(high)}
        else:
            rule = {"stat": stat, "level": kl_level, "direction": "pi_mu", **band}
        return {"reject": [rule], "weight": raw_token}
    if level == "token":
        if action == "mask":
            return {"reject": [{"stat": "ratio", "level": "token", **band}], "weight": raw_token}
        return {"weight": {"level": "token", "mode": "truncate", **band}}
    # sequence level, ratio metric: the geometric mean is the row's weight in every case
    geo_raw = {"level": "geometric", "mode": "truncate"}
    if agg == "max" and low is not None:
        raise _refuse(rs, "a lower bound on the row's maximum ρ_t keeps a row as soon as ONE token reaches it "
                      "(and with action 'clamp' clamps the weight only of rows where NO token does), so it bounds "
                      "neither the row's weight nor its worst token. Use offpolicy reject {stat: ratio, level: "
                      "any_token, low, high} (every token in the band) or {level: geometric, low, high}")
    if action == "mask":
        if agg == "max":  # max_t ρ_t ≤ U ⇔ every ρ_t ≤ U
            rule = {"stat": "ratio", "level": "any_token", "high": high}
        else:
            rule = {"stat": "ratio", "level": "geometric" if agg == "mean" else "sequence", **band}
        return {"reject": [rule], "weight": geo_raw}
    # clamp: rows outside the band get clamp(geo, lower or 0, upper), the others keep geo. For agg
    # mean that is truncating geo; for agg sum (upper > 1) and agg max (no lower) an in-band row's
    # geo already lies in [lower, upper] (geo ≤ max_t ρ_t; geo between 1 and Π ρ_t), so too —
    # except for agg sum with lower > 1, where an in-band Π ρ_t ≥ lower leaves geo below it.
    if agg == "sum" and low is not None and low > 1:
        raise _refuse(rs, "with lower > 1 a row whose product Π ρ_t passes keeps a geometric mean below lower "
                      "while a row that fails is lifted to lower: the weight is not monotone in the row's ratio. "
                      "Use agg 'mean' (offpolicy weight {level: geometric, mode: truncate, low, high})")
    return {"weight": {"level": "geometric", "mode": "truncate", **band}}


def loss_config(
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: Any = None,
    importance_sampling_level: str = "token",
    use_decoupled_loss: bool = False,
    m2_threshold: float | None = None,
    use_sapo_loss: bool = False,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    nonfinite: str = "error",
) -> LossConfig:
    """The LossConfig computing AReaL's actor loss for these ``PPOActorConfig`` fields; the
    defaults are AReaL's (``use_decoupled_loss=False``: PPO against μ, no correction — pass μ as
    ``old_logprobs``).

    ``rejection_sampling``: AReaL's RejectionSamplingConfig or a dict of its fields; None =
    none. ``nonfinite``: AReaL itself sets a non-finite log ρ to 0 (weight 1): ``neutral``
    reproduces that for metric ratio; the default ``error`` refuses non-finite inputs.

    Raises:
        ConfigError: a setting without a meaningful equivalent (module docstring), saying why.
    """
    if importance_sampling_level not in ("token", "sequence"):
        raise ConfigError(f"importance_sampling_level must be 'token' or 'sequence'; got {importance_sampling_level!r}")
    rs = _rs_fields(rejection_sampling)
    if use_sapo_loss:
        if use_decoupled_loss:
            raise ConfigError("use_sapo_loss with use_decoupled_loss: AReaL refuses it (SAPO has no proximal policy); "
                              "set use_decoupled_loss false")
        if rs is not None or m2_threshold is not None:
            raise ConfigError("use_sapo_loss: AReaL's sapo_loss_fn applies neither rejection_sampling nor (without a "
                              "proximal policy) M2PO; remove them")
        return LossConfig(kind="sapo", sapo_level=importance_sampling_level, sapo_tau_pos=sapo_tau_pos,
                          sapo_tau_neg=sapo_tau_neg, agg="token-mean")
    loss: dict[str, Any] = {
        "kind": "gspo" if importance_sampling_level == "sequence" else "ppo",
        "clip_low": eps_clip,
        "clip_high": eps_clip if eps_clip_higher is None else eps_clip_higher,
        "dual_clip": c_clip,
        "agg": "token-mean",
    }
    if loss["kind"] == "gspo":
        loss["gspo_form"] = "sequence"
    if not use_decoupled_loss:
        if rs is not None or m2_threshold is not None:
            given = " and ".join(k for k, v in (("rejection_sampling", rs), ("m2_threshold", m2_threshold)) if v is not None)
            raise ConfigError(f"{given} with use_decoupled_loss false (AReaL's default): AReaL ignores it there — "
                              "π_prox is μ itself, so π_prox/μ = 1 (it warns 'Filtering will be ignored'). Set "
                              "use_decoupled_loss=True (decoupled PPO, as AReaL needs for them), or drop it")
        return LossConfig(**loss)  # π_prox is μ itself: pass μ as old_logprobs, no correction
    correction: dict[str, Any] = {"anchor": "old", "log_clamp": None, "nonfinite": nonfinite}
    reject: list[dict[str, Any]] = []
    if m2_threshold is not None:
        reject.append({"stat": "m2", "high": m2_threshold})
    if rs is not None:
        fields = rejection_sampling_correction(rs)
        reject += fields.get("reject", [])
        if fields.get("weight"):
            correction["weight"] = fields["weight"]
        # AReaL counts the loss mask before rejection sampling, after M2PO (which edits it first):
        # the tokens left after the m2 rule (1; with no rejection rule after it that is renormalize)
        correction["denominator"] = 1 if m2_threshold is not None else "fixed"
    # M2PO edits the mask rejection sampling then sees
    correction.update(reject=reject, reject_mode="sequential")
    return LossConfig(**loss, correction=correction)
