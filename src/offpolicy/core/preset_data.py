"""The preset registry as plain data: one YAML file per framework in ``presets/``.

This module reads the YAML and nothing else — it does not know the typed configs, so that
``config.py`` (``CorrectionConfig.from_preset``) and ``presets/`` (typed helpers on top) both
depend on it and not on each other. A preset is ``framework:mode``; ``recommended`` (ours)
has no prefix.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from offpolicy.core.errors import ConfigError

OWN_FRAMEWORK = "offpolicy"
PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class PresetData:
    """A preset as written in its YAML file: the correction and loss fields are plain dicts."""

    name: str
    framework: str
    summary: str
    note: str
    correction: dict[str, Any] = field(repr=False)
    loss: dict[str, Any] = field(repr=False)


@lru_cache(maxsize=1)
def load_all() -> dict[str, PresetData]:
    """Every preset of every ``presets/*.yaml`` file, by name."""
    found: dict[str, PresetData] = {}
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        framework = data["framework"]
        shared_loss = data.get("loss", {})
        for mode, body in data["presets"].items():
            name = mode if framework == OWN_FRAMEWORK else f"{framework}:{mode}"
            found[name] = PresetData(
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
    return sorted(load_all(), key=lambda n: (":" in n, n))


def get(name: str) -> PresetData:
    """The preset called ``name``.

    Raises:
        ConfigError: unknown name (with the closest names and where to list them all).
    """
    presets = load_all()
    if name not in presets:
        close = difflib.get_close_matches(name, list(presets), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}.{hint} List them with `offpolicy presets`.")
    return presets[name]
