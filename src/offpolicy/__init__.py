"""offpolicy — measure and correct the rollout–training mismatch in RL for language models.

Public API (SPEC §8); everything else is internal.
"""

from offpolicy import presets
from offpolicy.config import ConfigError, CorrectionConfig, LossConfig
from offpolicy.correction import Correction, correct
from offpolicy.kl import kl_penalty
from offpolicy.losses import policy_loss
from offpolicy.metrics import Metrics
from offpolicy.sampling import renormalize_logprobs

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Correction",
    "CorrectionConfig",
    "LossConfig",
    "Metrics",
    "correct",
    "kl_penalty",
    "policy_loss",
    "presets",
    "renormalize_logprobs",
]
