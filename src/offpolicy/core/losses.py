"""``policy_loss``: the corrected policy loss (docs/specification.md §5), with the correction applied (docs/specification.md §3).

This module checks the call and picks an implementation from ``offpolicy.core.kernels`` (the
ladder reference → eager → compiled → triton; all compute the same numbers).

The formulas — each ``kind``'s per-token loss ℓ, the IS weight, the KL term on the ``kl_mask``
tokens (to ``ref_logprobs`` or, ``kl_to: rollout``, to μ) and each ``agg``'s division — are one
table, in docs/specification.md §5; ``kernels/reference.py`` computes it term by term. In short:
ppo ℓ = −min(r·A, clip(r)·A) with r = π_θ/π_old, then ℓ ← w·ℓ (+ β·KL_t), and token-mean divides
Σ ℓ by the count of the ``denominator``'s tokens.
"""

from __future__ import annotations

import os

import torch

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from offpolicy.core import centering, kernels
from offpolicy.core.centering import Support
from offpolicy.core.config import CorrectionConfig, LossConfig
from offpolicy.core.correction import correct
from offpolicy.core.errors import ConfigError
from offpolicy.core.metrics import Metrics


def as_loss_config(config: LossConfig | CorrectionConfig | dict[str, Any] | str | Path | None,
                   what: str = "policy_loss: config") -> LossConfig:
    """What users naturally pass as ``config=``: a LossConfig (as it is); None (PPO defaults); a dict of
    LossConfig fields; a CorrectionConfig (PPO defaults with that correction); its JSON (``{...}``: what a
    host hands a Ray worker); the path of a YAML file (fields, or under ``loss:``); or a preset name
    (``LossConfig.from_preset``: ``"recommended"``, ``"verl:bypass_ppo_clip"``).

    Raises:
        ConfigError: any other type (``what`` names where it came from), or an invalid config.
    """
    if config is None:
        return LossConfig()
    if isinstance(config, LossConfig):
        return config
    if isinstance(config, CorrectionConfig):
        return LossConfig(correction=config)
    if isinstance(config, dict):
        return LossConfig.from_dict(config)
    if isinstance(config, Path) or (isinstance(config, str) and (
            config.endswith((".yaml", ".yml")) or os.path.isfile(config))):
        return LossConfig.from_yaml(config)
    if isinstance(config, str):
        return LossConfig.model_validate_json(config) if config.lstrip().startswith("{") else LossConfig.from_preset(config)
    raise ConfigError(f"{what} must be a LossConfig, a CorrectionConfig, a dict of LossConfig fields, its JSON, "
                      f"a preset name or a YAML path; got {type(config).__name__}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None = None,
    config: LossConfig | CorrectionConfig | dict[str, Any] | str | Path | None = None,
    *,
    ref_logprobs: torch.Tensor | None = None,
    reduce: bool = True,
    implementation: str = "auto",
    support: Support | None = None,
    **removed: Any,
) -> tuple[torch.Tensor, Metrics] | tuple[torch.Tensor, torch.Tensor, Metrics]:
    """The corrected policy loss — the formulas are docs/specification.md §5's table.

    Args:
        logprobs:         [B, T] log π_θ(y_t), with grad.
        old_logprobs:     [B, T] log π_old(y_t); may be None under anchor 'rollout' (bypass:
                          π_old := μ) or for kind 'reinforce'.
        advantages:       [B, T] A_t (broadcast a per-sequence value yourself).
        mask:             [B, T] 1 for tokens that count.
        rollout_logprobs: [B, T] log μ(y_t); required when ``config.correction`` is set.
        config:           LossConfig (default: PPO, ε = 0.2, token-mean, no correction), or a
                          dict / CorrectionConfig / preset name / YAML path (``as_loss_config``).
        ref_logprobs:     [B, T] reference log-probs for the KL term (needed if kl_coef > 0,
                          unless ``kl_to`` is 'rollout': then the KL is to μ and this must be None;
                          when given, ``kl_ref`` is reported either way).
        reduce:           False returns the unreduced ``[B, T]`` loss for host frameworks.
        implementation:   "auto" (the fastest rung of ``offpolicy.core.kernels`` that covers the
                          configuration and suits the batch), or a rung by name: "reference"
                          (the readable oracle), "eager", "compiled", "triton" (raise if it does
                          not cover the configuration; non-finite inputs go to the reference).
        support:          score centering's support (``loss.score_centering``; docs/estimators.md#score-centering),
                          one ``offpolicy.Support`` over K token ids v of each token's support — the engine's
                          kept set (``exact``: p renormalised over it, ``sampling.renormalize_logprobs(keep=...)``)
                          or a top-k head (``head``: over the full vocabulary): ``ids`` [B, T, K], the sampler's
                          ``rollout_logprobs`` log q_v (−inf pads), the trainer's ``logprobs`` log p_v with grad
                          (``centering.support_logprobs`` gathers them from logits) and, for kinds ppo / cispo
                          under anchor old, ``old_logprobs`` log π_old(v). None: the loss is not centred
                          (``score_centering/applied`` reads 0).

    Returns:
        reduce=True:  (loss scalar, metrics).
        reduce=False: (per_token [B, T] with weights applied and rejected/padding tokens 0,
                       aggregation mask [B, T] — surviving tokens under ``renormalize``, valid
                       tokens under ``fixed`` — and metrics).

    Raises:
        TypeError: an argument this function does not take; the loose ``support_logprobs``,
            ``support_rollout_logprobs`` and ``support_old_logprobs`` of 0.1 name ``support=`` (no alias: 0.x).
        ValueError: invalid inputs (see ``correct``) or a tensor the config needs is missing.
    """
    if removed:
        raise TypeError(_removed_arguments(removed))
    cfg = as_loss_config(config)
    corr_cfg = cfg.correction
    if cfg.kl_to == "rollout":
        if ref_logprobs is not None:
            raise ValueError("kl_to 'rollout' takes the KL term to rollout_logprobs (μ); ref_logprobs= must not be "
                             "given as well (set kl_to 'ref' to use it)")
        if rollout_logprobs is None:
            raise ValueError("kl_to 'rollout' takes the KL term to μ, so rollout_logprobs is required")
        ref_logprobs = rollout_logprobs
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs= (or kl_to 'rollout' for a KL to μ)")
    if corr_cfg is not None and rollout_logprobs is None:
        raise ValueError("config.correction is set, so rollout_logprobs (log μ from the inference engine) is required")
    if corr_cfg is not None and corr_cfg.anchor == "old" and old_logprobs is None:
        # checked here, once, so that every rung raises the same error (issue #9 item 2: the
        # compiled rung used π_θ as π_old under REINFORCE)
        raise ConfigError(
            "correction.anchor 'old' compares log π_old with log μ, so old_logprobs is required; pass it, "
            "or set correction.anchor to 'current' (log ρ = sg(log π_θ) − log μ) or 'rollout' (bypass)"
        )
    if corr_cfg is not None and corr_cfg.anchor == "rollout":
        old_logprobs = rollout_logprobs  # bypass: PPO's ratio becomes π_θ/μ
    if old_logprobs is None and cfg.kind != "reinforce":
        raise ValueError(f"kind '{cfg.kind}' needs old_logprobs (or correction.anchor 'rollout' to use μ as π_old)")
    centering.validate_support(cfg, mask, support)
    for rung in kernels.choose(cfg, ref_logprobs, mask, implementation):
        if cfg.score_centering is not None:  # only the reference computes it (the fast rungs' supports refuse it)
            out = rung.policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, cfg, reduce, ref_logprobs,
                                   support=support)
        else:
            out = rung.policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, cfg, reduce,
                                   ref_logprobs)
        if out is not None:
            return out
    raise AssertionError("the reference implementation always returns")  # pragma: no cover


# the loose score-centering tensors of 0.1, now the fields of one ``Support`` (issue #68)
_SUPPORT_FIELDS = {"support_logprobs": "logprobs", "support_rollout_logprobs": "rollout_logprobs",
                   "support_old_logprobs": "old_logprobs"}


def _removed_arguments(given: dict[str, Any]) -> str:
    """The TypeError's text for keyword arguments ``policy_loss`` does not take: the old support tensors name the
    ``Support`` field each became; any other name is unknown."""
    old = [name for name in given if name in _SUPPORT_FIELDS]
    if not old:
        return f"policy_loss() got an unexpected keyword argument {next(iter(given))!r}"
    fields = ", ".join(f"{name} → Support.{_SUPPORT_FIELDS[name]}" for name in old)
    return (f"policy_loss() no longer takes {', '.join(old)}: score centering's support is one argument, "
            f"support=offpolicy.Support(ids, rollout_logprobs, form, logprobs=..., old_logprobs=...) ({fields}; "
            "ids [B, T, K] are the support's token ids, form the loss's score_centering)")


_MICRO_BATCH_KEYS = ("old_logprobs", "rollout_logprobs", "mask", "logprobs", "advantages")


def with_global_normalizer(
    config: LossConfig | CorrectionConfig | dict[str, Any] | str | Path | None,
    micro_batches: Iterable[Mapping[str, torch.Tensor | None]],
    *,
    group: torch.distributed.ProcessGroup | None = None,
) -> LossConfig:
    """``config`` with the loss denominator of one optimizer step filled in, so that the losses
    of its micro-batches, on every rank of ``group``, add up to the loss of one big batch
    (issue #9 item 10): call it once per step, before the micro-batches' forwards.

        token-mean:                global_tokens = Σ_micro-batches Σ_ranks N_tokens
        seq-mean-token-*:          global_seqs   = Σ_micro-batches Σ_ranks #rows with ≥ 1 token

    where a token counts when it survives the rejection rules (``denominator: renormalize``),
    is valid (``fixed``; NaN/inf masked by ``nonfinite`` do not count) or survives the first n
    rules (an integer n; ``Correction.count_mask``) — the same count
    ``policy_loss`` divides by when no global count is set. The counts are summed over the ranks
    with one all-reduce when torch.distributed is initialised. A count of 0 (everything
    rejected) becomes 1: the loss is 0 either way.

    Each micro-batch maps ``mask`` and, when the correction has rules to evaluate,
    ``rollout_logprobs`` and ``old_logprobs`` (anchor ``old``) — the tensors ``correct`` reads.
    Rules on π_θ (anchors ``rollout``/``current``, ``opsm``) also need ``logprobs`` (and
    ``advantages`` for ``opsm``): π_θ does not change between the micro-batches of one step, so a
    no-grad forward gives them. ``seq-mean-token-sum-norm`` needs ``max_len`` set: micro-batches
    padded to different lengths would otherwise divide by different T.

    With data-chosen bounds or ``weight.normalize``, pass the config ``resolve_thresholds``
    returns, so the counts use the step's bounds and every micro-batch divides by the step's
    mean weight (per call, each would divide by its own).

    Raises:
        ConfigError: seq-mean-token-sum-norm without ``max_len``.
        ValueError: a micro-batch without ``mask``, or one the correction cannot read.
    """
    cfg = as_loss_config(config)
    if cfg.agg == "seq-mean-token-sum-norm" and cfg.max_len is None:
        raise ConfigError(
            "agg 'seq-mean-token-sum-norm' divides each row by max_len, which defaults to the micro-batch's T; "
            "set loss.max_len (e.g. the response length limit) so every micro-batch divides by the same number"
        )
    corr_cfg = cfg.correction
    tokens = None
    for i, mb in enumerate(micro_batches):
        unknown = set(mb) - set(_MICRO_BATCH_KEYS)
        if "mask" not in mb or unknown:
            raise ValueError(
                f"micro-batch {i}: expected a mapping with 'mask' and some of {', '.join(_MICRO_BATCH_KEYS[:2] + _MICRO_BATCH_KEYS[3:])}"
                + (f"; unknown keys {sorted(unknown)}" if unknown else "")
            )
        if corr_cfg is None:
            counted = mb["mask"].bool()
        else:
            corr = correct(
                mb.get("old_logprobs"), mb.get("rollout_logprobs"), mb["mask"], corr_cfg,
                logprobs=mb.get("logprobs"), advantages=mb.get("advantages"),
            )
            counted = corr.count_mask.bool()
        count = torch.stack([counted.sum(), counted.any(dim=-1).sum()]).to(torch.float64)
        tokens = count if tokens is None else tokens + count.to(tokens.device)
    if tokens is None:
        raise ValueError("with_global_normalizer: no micro-batches given")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=group)
    n_tokens, n_seqs = (max(1.0, float(x)) for x in tokens.tolist())
    field = {"global_tokens": n_tokens} if cfg.agg == "token-mean" else {"global_seqs": n_seqs}
    return LossConfig(**{**cfg.model_dump(exclude={"global_tokens", "global_seqs", "correction"}),
                         "correction": corr_cfg, **field})
