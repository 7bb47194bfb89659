"""offpolicy — measure and correct the rollout–training mismatch in RL for language models.

Public API (docs/specification.md §8); everything else is internal.
"""

from offpolicy.core import presets
from offpolicy.core.centering import Support
from offpolicy.core.config import ConfigError, CorrectionConfig, LossConfig
from offpolicy.core.correction import Correction, correct, split_metrics
from offpolicy.core.kl import kl_penalty
from offpolicy.core.losses import policy_loss, with_global_normalizer
from offpolicy.core.metrics import Metrics
from offpolicy.core.proximal import loglinear_proximal
from offpolicy.core.sampling import outside_mass_metrics, renormalize_logprobs
from offpolicy.core.step import resolve_thresholds

__version__ = "0.1.0"

# Issue #68 gave the correction core and the measuring code a folder each. The old module paths fail with the new
# one named (the project is 0.x: no silent aliases): ``import offpolicy.correction`` through the finder below,
# ``from offpolicy import correction`` through both, ``offpolicy.correction`` through ``__getattr__``.
_MOVED = {**{name: f"offpolicy.core.{name}" for name in (
    "centering", "config", "correction", "errors", "kept_set", "kernels", "kl", "losses", "metrics", "ops",
    "preset_data", "proximal", "sampling", "sequence_weight", "step", "thresholds")},
    **{name: f"offpolicy.measure.{name}" for name in (
        "diagnose", "diagnose_config", "provenance", "self_check", "sync_check", "viewer")}}


def _moved(fullname: str) -> str | None:
    """Where a module of the old layout is now, as a sentence; None for any other name."""
    parts = fullname.split(".")
    if len(parts) < 2 or parts[0] != "offpolicy" or parts[1] not in _MOVED:
        return None
    new = ".".join([_MOVED[parts[1]], *parts[2:]])
    return (f"{fullname} moved to {new} (issue #68: the correction core is offpolicy.core, the measuring code "
            f"offpolicy.measure); import it from there")


class _MovedFinder:
    """A meta-path finder, last in line: an old module path that no file answers fails with its new path."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        where = _moved(fullname)
        if where is not None:
            raise ImportError(where, name=fullname)
        return None


def __getattr__(name: str):
    """``offpolicy.correction`` and the like: an AttributeError naming the new path (``from offpolicy import
    correction`` then asks the import system, whose finder above raises the ImportError)."""
    raise AttributeError(_moved(f"offpolicy.{name}") or f"module 'offpolicy' has no attribute {name!r}")


if not any(isinstance(f, _MovedFinder) for f in __import__("sys").meta_path):
    __import__("sys").meta_path.append(_MovedFinder())

__all__ = [
    "ConfigError",
    "Correction",
    "CorrectionConfig",
    "LossConfig",
    "Metrics",
    "Support",
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
