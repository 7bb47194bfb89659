"""Load a host framework's loss code on this CPU machine without its GPU-only package ``__init__``.

SkyRL 0.4.0's ``skyrl/backends/__init__`` imports its Tinker backend, whose pydantic models need
Python ≥ 3.12; OpenRLHF 0.11.2's ``openrlhf/models/__init__`` imports DeepSpeed and flash-attn. The
modules the adapters are tested against (SkyRL's ``ppo_utils``, OpenRLHF's ``loss``) need neither, so
the tests register the parent package bare — its ``__path__`` only, ``__init__`` not run — and import
the real module under it. Plain modules (no pytest) so that worker scripts run in a fresh process
can use them too.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def bare_package(name: str) -> types.ModuleType:
    """Register package ``name`` (e.g. ``"skyrl.backends"``) with its path and without running its
    ``__init__``; earlier, half-imported entries of it are dropped from ``sys.modules`` first."""
    parent, _, leaf = name.rpartition(".")
    root = importlib.import_module(parent)
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    pkg = types.ModuleType(name)
    pkg.__path__ = [f"{root.__path__[0]}/{leaf}"]
    pkg.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = pkg
    return pkg


def import_skyrl_module(module: str = "skyrl.backends.skyrl_train.utils.ppo_utils") -> types.ModuleType:
    """``module`` under ``skyrl.backends``, through the bare package where its ``__init__`` fails."""
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001 - on 3.11 a pydantic error (or a Tinker-only dependency) from its __init__
        bare_package("skyrl.backends")
        return importlib.import_module(module)


def import_openrlhf_loss() -> types.ModuleType:
    """``openrlhf.models.loss``, through the bare ``openrlhf.models`` where DeepSpeed or flash-attn is
    missing; a placeholder ``deepspeed`` module is present only during that import (transformers probes
    for DeepSpeed and must not find a fake one later)."""
    try:
        return importlib.import_module("openrlhf.models.loss")
    except ImportError:
        pass
    bare_package("openrlhf.models")
    added = "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is None
    if added:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    try:
        return importlib.import_module("openrlhf.models.loss")
    finally:
        if added:
            del sys.modules["deepspeed"]


def worker_pythonpath(placeholders_for: tuple[str, ...]) -> str:
    """PYTHONPATH for a host worker run in a fresh process: tests/ and src/, then the caller's; the GPU
    packages' placeholders (tests/gpu_placeholders) first only where one of ``placeholders_for`` is missing
    (placed first they would shadow a real install)."""
    parts = [str(TESTS), str(TESTS.parent / "src")]
    if any(importlib.util.find_spec(m) is None for m in placeholders_for):
        parts.insert(0, str(TESTS / "gpu_placeholders"))
    return os.pathsep.join(parts + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def worker_env(placeholders_for: tuple[str, ...]) -> dict[str, str]:
    """The environment of such a worker: ``worker_pythonpath`` and one OpenMP thread."""
    return {**os.environ, "PYTHONPATH": worker_pythonpath(placeholders_for), "OMP_NUM_THREADS": "1"}
