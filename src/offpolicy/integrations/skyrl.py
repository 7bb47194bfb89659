"""offpolicy inside SkyRL 0.4.0 (skyrl-train backend: Ray + FSDP/Megatron + vLLM).

SkyRL looks policy losses up by name in ``PolicyLossRegistry``
(``skyrl/backends/skyrl_train/utils/ppo_utils.py``, 0.4.0) and its worker calls the one named by
``trainer.algorithm.policy_loss_type`` once per micro-batch
(``skyrl/backends/skyrl_train/workers/worker.py``, 0.4.0):

    policy_loss, loss_metrics = loss_fn(action_log_probs, old_action_log_probs, advantages,
                                        config=cfg.algorithm, loss_mask=loss_mask,
                                        rollout_logprobs=experience.rollout_logprobs)

and adds ``loss_metrics`` to its status as ``loss_metrics/<name>``. SkyRL aggregates *before* the
loss: ``apply_loss_reduction_to_advantages_minibatch`` divides A by the normaliser of
``algorithm.loss_reduction`` (token_mean: Σ mask over the mini-batch; sequence_mean: B·|y_i|; ...)
and every loss returns the plain sum ``Σ_t ℓ_t m_t`` (``reduce_loss``). The "offpolicy" loss
registered here therefore returns

    ℓ_t, m_t = op.policy_loss(log π_θ, log π_old, Â, mask, log μ, cfg, reduce=False);  loss = Σ_t ℓ_t m_t

with Â SkyRL's pre-scaled advantages — for a positively homogeneous surrogate (PPO, GSPO, CISPO,
REINFORCE: ℓ(c·A) = c·ℓ(A), c > 0) this equals offpolicy's own reduction of the unscaled loss.

Use (driver, before the trainer starts; ``register`` is idempotent and SkyRL ships registered
losses to the workers through its Ray registry actor):

    from offpolicy.integrations import skyrl as op_skyrl
    op_skyrl.register("recommended")           # LossConfig, CorrectionConfig, preset name or YAML path
    op_skyrl.configure(cfg)                    # your SkyRLTrainConfig: policy_loss_type "offpolicy",
                                               # rollout log-probs on, SkyRL's own correction refused

Refused: SkyRL's ``algorithm.off_policy_correction`` enabled together with offpolicy's (the ratio
π_old/μ would be applied twice); ``loss.kl_coef`` > 0 with ``kl_to: ref`` (SkyRL adds its KL
itself via ``use_kl_loss``; the loss never sees reference log-probs; a KL to μ, ``kl_to: rollout``,
is computed by offpolicy); ``correction.denominator:
renormalize`` (SkyRL's normaliser is fixed before the loss runs); a surrogate that is not
positively homogeneous in A (``sapo``).
Host defaults (``offpolicy.integrations.host``): an unset ``nonfinite`` is ``neutral``; a
micro-batch without a valid token gives SkyRL's zero sum and ``all_masked_micro_batch`` = 1.
SkyRL's ``eps_clip_*`` / ``clip_ratio_c`` are not read: the LossConfig's clip applies. The
aggregation is SkyRL's ``loss_reduction`` (any of them); the LossConfig's ``agg`` is not used.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import offpolicy as op
from offpolicy.core.config import ConfigError, CorrectionConfig, LossConfig
from offpolicy.integrations import host
from offpolicy.integrations.dump import BatchDumper

try:
    from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import off_policy_correction_enabled
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
except ImportError as _err:  # pragma: no cover - exercised only without SkyRL
    raise ImportError(
        f"offpolicy.integrations.skyrl needs SkyRL ({_err}); install it with `pip install offpolicy[skyrl]` "
        "(SkyRL 0.4.0 requires Python >= 3.12)"
    ) from _err

NAME = "offpolicy"
TESTED_VERSIONS = ("0.4.0",)
METRIC_PREFIX = "offpolicy/"


def host_version() -> str:
    return host.host_version("skyrl")


def resolve_config(spec: LossConfig | CorrectionConfig | str) -> LossConfig:
    """A LossConfig from a LossConfig, a CorrectionConfig (PPO ε = 0.2 around it), a preset name or a YAML path."""
    return host.loss_config_of(spec, "skyrl loss config")


class OffpolicyLoss:
    """The callable registered as ``policy_loss_type: offpolicy`` (SkyRL 0.4 contract: returns
    ``(loss, metrics)``, loss = Σ_t ℓ_t m_t over pre-scaled advantages; metrics ``offpolicy/<name>``
    floats). A class instance rather than a closure so SkyRL's registry actor (cloudpickle) ships
    the LossConfig to every worker with it."""

    def __init__(self, config: LossConfig, dumper: BatchDumper | None = None) -> None:
        host.check_kl(config, "SkyRL", "trainer.algorithm.use_kl_loss, kl_loss_coef")
        host.check_fixed_denominator(config, "SkyRL divides the advantages by its token/sequence count before "
                                     "the loss runs")
        if config.kind == "sapo":
            raise ConfigError(
                "loss.kind='sapo': SkyRL's loss_reduction rescales A before the loss, which is exact only for "
                "surrogates linear in A (ppo, gspo, cispo, reinforce); use SkyRL's own policy_loss_type sapo"
            )
        self.config = host.host_nonfinite_default(config, "SkyRL")
        self.dumper = dumper
        self.calls = 0

    def check_algorithm(self, algorithm: Any) -> None:
        """Refuse a SkyRL ``AlgorithmConfig`` under which offpolicy's loss would be wrong or doubled."""
        if off_policy_correction_enabled(algorithm.off_policy_correction):
            raise ConfigError(
                "trainer.algorithm.off_policy_correction is enabled (tis_ratio_type / sequence_mask_metric / "
                "outlier_token_is_threshold_* / token_mask_is_threshold_*) while policy_loss_type is 'offpolicy': "
                "π_old/μ would be corrected twice. Put the correction in offpolicy's LossConfig and leave SkyRL's "
                "off_policy_correction at its defaults (all None)"
            )

    def __call__(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 config: Any, loss_mask: torch.Tensor | None = None,
                 rollout_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        self.check_algorithm(config)
        cfg = self.config
        if cfg.correction is not None and rollout_logprobs is None:
            raise RuntimeError(
                "offpolicy loss: rollout_logprobs is None — set generator.sampling_params.logprobs: 1 "
                "(offpolicy.integrations.skyrl.configure(cfg) does)"
            )
        mask = loss_mask if loss_mask is not None else torch.ones_like(log_probs)
        if not host.has_valid_token(mask):  # SkyRL's own Σ_t ℓ_t m_t is 0 here; offpolicy refuses the batch
            loss, metrics = host.empty_loss(log_probs, mask)
            self.calls += 1
            return loss, host.host_floats(metrics, METRIC_PREFIX)
        per_token, agg_mask, metrics = op.policy_loss(
            log_probs, old_log_probs, advantages, mask, rollout_logprobs, cfg, reduce=False)
        loss = (per_token * agg_mask.to(per_token.dtype)).sum()  # SkyRL's reduce_loss: Σ over pre-scaled A
        host.micro_batch_metrics(metrics)
        if self.dumper is not None and rollout_logprobs is not None:
            self.dumper.maybe_dump(self.calls, old_logprobs=old_log_probs, rollout_logprobs=rollout_logprobs,
                                   mask=mask, logprobs=log_probs,
                                   meta={"step_unit": "loss call (micro-batch)", "advantages": "omitted (pre-scaled)"})
        self.calls += 1
        return loss, host.host_floats(metrics, METRIC_PREFIX)


def register(config: LossConfig | CorrectionConfig | str, *, dumper: BatchDumper | None = None) -> OffpolicyLoss:
    """Register offpolicy's loss as ``"offpolicy"`` in SkyRL's ``PolicyLossRegistry``.

    Registering the same LossConfig again is a no-op (returns the registered loss); a different one
    replaces ours; a foreign loss already registered under ``"offpolicy"`` is an error.
    """
    if host_version() not in TESTED_VERSIONS and os.environ.get("OFFPOLICY_SKYRL_ANY_VERSION") != "1":
        raise RuntimeError(
            f"offpolicy.integrations.skyrl was written against SkyRL {', '.join(TESTED_VERSIONS)} (the registry, "
            f"the (loss, metrics) contract, loss_reduction by advantage scaling); found {host_version()}. "
            "Install skyrl==0.4.0, or set OFFPOLICY_SKYRL_ANY_VERSION=1 after checking those contracts."
        )
    loss = OffpolicyLoss(resolve_config(config), dumper)
    if NAME in PolicyLossRegistry.list_available():
        current = PolicyLossRegistry.get(NAME)
        if not isinstance(current, OffpolicyLoss):
            raise ConfigError(
                f"SkyRL's PolicyLossRegistry already holds a different loss named {NAME!r} ({current!r}); "
                "unregister it (PolicyLossRegistry.unregister) before offpolicy registers its own"
            )
        if current.config == loss.config and dumper is None:
            return current
        PolicyLossRegistry.unregister(NAME)
    PolicyLossRegistry.register(NAME, loss)
    return loss


def configure(cfg: Any) -> Any:
    """Point a ``SkyRLTrainConfig`` at the registered offpolicy loss: ``policy_loss_type`` "offpolicy",
    ``generator.sampling_params.logprobs`` 1 (log μ of the sampled token), and refuse what the
    registered loss would refuse (SkyRL's own correction on)."""
    if NAME not in PolicyLossRegistry.list_available():
        raise ConfigError("configure(cfg) before register(config): SkyRL has no 'offpolicy' loss yet")
    alg = cfg.trainer.algorithm
    PolicyLossRegistry.get(NAME).check_algorithm(alg)
    alg.policy_loss_type = NAME
    sp = cfg.generator.sampling_params
    if sp.logprobs is None:
        sp.logprobs = 1
    return cfg
