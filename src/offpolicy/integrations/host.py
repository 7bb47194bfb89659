"""What every adapter does the same way under its host's defaults (issue #27).

* ``host_nonfinite_default``: a correction whose ``nonfinite`` is left unset runs with
  ``neutral`` inside a host (ρ = 1 on a token whose log-prob is NaN/±inf; π_θ, A or π_ref bad:
  the token is masked). TRL does exactly this for vLLM's ``None`` log-probs; verl, OpenRLHF and
  SkyRL have no rule and would carry the NaN into their loss. The library default ``error``
  would end a multi-day run on one bad token. An explicit ``nonfinite`` is kept. Counted as
  ``offpolicy/nonfinite_tokens``.
* ``empty_loss``: a micro-batch without a valid token (TRL ``mask_truncated_completions``, a
  multi-turn batch of tool output only, a padded micro-batch) gives the zero every host gives
  there (a masked sum over no token), connected to π_θ's graph so that data-parallel gradient
  hooks still fire; ``op.policy_loss`` itself refuses such a batch (nothing to train on).
  Reported as ``offpolicy/all_masked_micro_batch`` (1 there, 0 on every other micro-batch).
* ``host_floats``: the metrics of one call as the floats a host logs. verl, OpenRLHF and SkyRL
  average each micro-batch's floats over the step and the data-parallel ranks (verl, SkyRL: plain
  means; OpenRLHF: token-weighted), so a statistic over no units — ``clip_fraction`` and the
  ``is_*`` weight statistics of a micro-batch whose tokens were all rejected, e.g. every
  micro-batch of a rank whose tokens the correction rejected — reads 0 there, as these hosts' own
  ``masked_mean`` gives, instead of the library's NaN, which the host's average would spread to
  the step's value on every rank. The library's own ``Metrics`` keep NaN (no contribution
  anywhere); ``masked_fraction`` / ``all_masked_micro_batch`` say how many tokens were rejected.
* ``check_kl``: the hosts verl / OpenRLHF / SkyRL add their own KL to a reference model and never
  hand the loss reference log-probs; a KL to μ (``kl_to: rollout``, prime-rl's presets) needs no
  reference model, so offpolicy computes it on the μ the host passes.
* ``loss_config_of``: one reading of what a user hands an adapter as its loss — a ``LossConfig``, a
  ``CorrectionConfig``, a dict, JSON, a YAML path or a preset name; ``host_version``: an installed
  host's version, for its version check and its dumps.
"""

from __future__ import annotations

import logging
import math
from importlib import metadata
from typing import Any

import torch

import offpolicy as op
from offpolicy.core.config import ConfigError, CorrectionConfig, LossConfig
from offpolicy.core.kernels.common import per_config
from offpolicy.core.losses import as_loss_config

logger = logging.getLogger(__name__)


@per_config(64)
def host_nonfinite_default(config: op.LossConfig, host: str) -> op.LossConfig:
    """``config`` with ``correction.nonfinite = 'neutral'`` where the field was left unset (module docstring).

    The same input object gives the same output object (verl resolves its config on every call, and
    the kernels cache what they support per config object: ``kernels.common.per_config``)."""
    corr = config.correction
    if corr is None or "nonfinite" in corr.model_fields_set:
        return config
    logger.info("offpolicy (%s): correction.nonfinite left unset: 'neutral' (ρ = 1 on a non-finite log-prob, "
                "as TRL does for vLLM's None); counted as offpolicy/nonfinite_tokens", host)
    return config.model_copy(update={"correction": corr.model_copy(update={"nonfinite": "neutral"})})


def has_valid_token(mask: torch.Tensor) -> bool:
    """Whether ``mask`` ``[B, T]`` holds a token that counts (one host synchronisation)."""
    return mask.numel() > 0 and bool(mask.any())


def empty_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, op.Metrics]:
    """(0 on π_θ's graph with a zero gradient, metrics saying so) for a micro-batch without a valid token.

    ``where`` (not ``0 · log π``) so that a NaN log-prob on a masked position cannot make it NaN."""
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    loss = torch.where(mask != 0, logprobs.float(), zero).sum()
    return loss, micro_batch_metrics(op.Metrics(), empty=True)


def micro_batch_metrics(metrics: op.Metrics, empty: bool = False) -> op.Metrics:
    """Record ``all_masked_micro_batch`` on every micro-batch, so the key set is the same on all of them."""
    metrics.sum("all_masked_micro_batch", float(empty))
    return metrics


def host_floats(metrics: op.Metrics, prefix: str = "offpolicy/") -> dict[str, float]:
    """``metrics.to_dict(prefix)`` with a statistic over no units (NaN there) as 0.0 (module docstring)."""
    return {k: 0.0 if math.isnan(v) else v for k, v in metrics.to_dict(prefix=prefix).items()}


def check_kl(config: op.LossConfig, host: str, host_kl: str) -> None:
    """Refuse a KL to a reference model inside a host that owns that term (``host_kl`` names its options).

    Raises:
        ConfigError: ``kl_coef`` > 0 with ``kl_to: ref``.
    """
    if config.kl_coef > 0 and config.kl_to == "ref":
        raise ConfigError(
            f"loss.kl_coef={config.kl_coef} with kl_to 'ref': {host} adds the KL to a reference model itself "
            f"({host_kl}) and never passes reference log-probs to the loss; set loss.kl_coef 0 and use {host}'s. "
            "(A KL to the sampling log-probs μ, kl_to 'rollout', is computed here.)"
        )


def check_fixed_denominator(config: op.LossConfig, why: str) -> None:
    """Refuse any ``correction.denominator`` but ``fixed`` (``renormalize``, or an integer count after the first
    n rules) inside a host that fixes the loss's count before the loss runs (``why`` says how it does).

    Raises:
        ConfigError: a correction whose denominator is not ``fixed``.
    """
    if config.correction is not None and config.correction.denominator != "fixed":
        raise ConfigError(f"loss.correction.denominator={config.correction.denominator!r}: {why}, so rejected tokens cannot leave the "
                          "denominator; set correction.denominator 'fixed' (e.g. op.presets.loss('recommended') with "
                          "correction.denominator='fixed')")


def loss_config_of(spec: LossConfig | CorrectionConfig | dict[str, Any] | str, what: str = "loss config") -> LossConfig:
    """A ``LossConfig`` from what a host's user passes (``losses.as_loss_config``: a LossConfig, a
    CorrectionConfig, a dict, its JSON, a YAML path or a preset name); unlike ``policy_loss``'s
    ``config=``, a host's option left unset is an error, not PPO's defaults.

    Raises:
        ConfigError: ``spec`` is none of these (``what`` names where it came from), or an invalid config.
    """
    if spec is None:
        raise ConfigError(f"{what} must be a LossConfig, a CorrectionConfig, a dict of LossConfig fields, its JSON, "
                          "a preset name or a YAML path; got NoneType")
    return as_loss_config(spec, what)


def host_version(package: str) -> str:
    """The installed version of the host's distribution ``package`` ("unknown" where it has no metadata)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:  # pragma: no cover
        return "unknown"
