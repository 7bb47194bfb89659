"""offpolicy — measure and correct the rollout–training mismatch in RL for language models.

Public API (docs/specification.md §8); everything else is internal.
"""

from offpolicy import presets
from offpolicy.config import ConfigError, CorrectionConfig, LossConfig
from offpolicy.correction import Correction, correct, split_metrics
from offpolicy.kl import kl_penalty
from offpolicy.losses import policy_loss, with_global_normalizer
from offpolicy.metrics import Metrics
from offpolicy.proximal import loglinear_proximal
from offpolicy.sampling import outside_mass_metrics, renormalize_logprobs
from offpolicy.step import resolve_thresholds

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Correction",
    "CorrectionConfig",
    "LossConfig",
    "Metrics",
    "correct",
    "kl_penalty",
    "loglinear_proximal",
    "outside_mass_metrics",
    "policy_loss",
    "presets",
    "renormalize_logprobs",
    "resolve_thresholds",
    "split_metrics",
    "with_global_normalizer",
]
