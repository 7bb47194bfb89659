"""Presets: one YAML file per framework, each reproducing that framework's exact semantics.

A preset is ``framework:mode`` (``recommended`` is ours and has no prefix). Each carries a
``CorrectionConfig``, the loss settings that go with the framework, a one-line summary and a
note on the framework behaviour it reproduces, quirks included (SPEC §9).

    >>> import offpolicy as op
    >>> "verl:decoupled_token_is" in op.presets.names()
    True
    >>> op.presets.get("trl:sequence_mask").correction_config().log_clamp is None
    True
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from offpolicy.config import ConfigError, CorrectionConfig, LossConfig

OWN_FRAMEWORK = "offpolicy"


@dataclass(frozen=True)
class Preset:
    name: str
    framework: str
    summary: str
    note: str
    correction: dict[str, Any] = field(repr=False)
    loss: dict[str, Any] = field(repr=False)

    def correction_config(self) -> CorrectionConfig:
        try:
            return CorrectionConfig.from_dict(dict(self.correction))
        except ConfigError as err:
            raise ConfigError(f"preset {self.name!r}: {err}") from None

    def loss_config(self, **overrides: Any) -> LossConfig:
        """The framework's loss settings with this correction (``overrides`` win)."""
        data = {**self.loss, "correction": self.correction_config(), **overrides}
        try:
            return LossConfig(**data)
        except ConfigError as err:
            raise ConfigError(f"preset {self.name!r}: {err}") from None


@lru_cache(maxsize=1)
def _load_all() -> dict[str, Preset]:
    found: dict[str, Preset] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".yaml"):
            continue
        data = yaml.safe_load(entry.read_text())
        framework = data["framework"]
        shared_loss = data.get("loss", {})
        for mode, body in data["presets"].items():
            name = mode if framework == OWN_FRAMEWORK else f"{framework}:{mode}"
            found[name] = Preset(
                name=name,
                framework=framework,
                summary=body["summary"],
                note=body["note"],
                correction=body.get("correction", {}),
                loss={**shared_loss, **body.get("loss", {})},
            )
    return found


def names() -> list[str]:
    """Every preset name, ``recommended`` first, then by framework."""
    all_names = list(_load_all())
    return sorted(all_names, key=lambda n: (":" in n, n))


def get(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ConfigError: unknown name (with the closest names and where to list them all).
    """
    presets = _load_all()
    if name not in presets:
        close = difflib.get_close_matches(name, list(presets), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}.{hint} List them with `offpolicy presets`.")
    return presets[name]


def correction(name: str) -> CorrectionConfig:
    return get(name).correction_config()


def loss(name: str, **overrides: Any) -> LossConfig:
    return get(name).loss_config(**overrides)
