"""Presets: one YAML file per framework, each reproducing that framework's exact semantics.

A preset is ``framework:mode`` (``recommended`` is ours and has no prefix). Each carries a
``CorrectionConfig``, the loss settings that go with the framework, a one-line summary and a
note on the framework behaviour it reproduces, quirks included (docs/specification.md §9). The YAML is read by
``offpolicy.core.preset_data``; this module adds the typed views.

    >>> import offpolicy as op
    >>> "verl:decoupled_token_is" in op.presets.names()
    True
    >>> op.presets.get("trl:sequence_mask").correction_config().log_clamp is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offpolicy.core import preset_data
from offpolicy.core.config import CorrectionConfig, LossConfig
from offpolicy.core.preset_data import OWN_FRAMEWORK, names

__all__ = ["OWN_FRAMEWORK", "Preset", "correction", "get", "loss", "names"]


@dataclass(frozen=True)
class Preset(preset_data.PresetData):
    """A preset with typed views of its correction and loss settings."""

    def correction_config(self) -> CorrectionConfig:
        return CorrectionConfig.from_preset(self.name)

    def loss_config(self, **overrides: Any) -> LossConfig:
        """The framework's loss settings with this correction (``overrides`` win)."""
        return LossConfig.from_preset(self.name, **overrides)


def get(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ConfigError: unknown name (with the closest names and where to list them all).
    """
    data = preset_data.get(name)
    return Preset(**{f: getattr(data, f) for f in data.__dataclass_fields__})


def correction(name: str) -> CorrectionConfig:
    return CorrectionConfig.from_preset(name)


def loss(name: str, **overrides: Any) -> LossConfig:
    return LossConfig.from_preset(name, **overrides)
