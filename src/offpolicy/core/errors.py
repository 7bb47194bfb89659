"""The package's one configuration error type (re-exported as ``offpolicy.ConfigError``)."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message names the path, the value and the fix."""
